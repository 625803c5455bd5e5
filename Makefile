# Everything installs itself: `make demo` and `make test` work on a fresh Debian machine with
# Python 3.11 and Java 17.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint proto bench chaos clean venv sysdeps

venv: $(STAMP)

$(STAMP): requirements.lock pyproject.toml
	@command -v $(PY) >/dev/null || { echo "need $(PY)"; exit 1; }
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --no-cache-dir -r requirements.lock
	$(BIN)/pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

# Debian packages the demo and the tests run for real: etcd (the coordinator). The tests install
# radosgw and prometheus themselves when they first need them (tests/aptutil.py).
sysdeps:
	@command -v etcd >/dev/null && command -v etcdctl >/dev/null || { \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -q --no-install-recommends etcd-server etcd-client >/dev/null 2>&1 || \
	  { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends etcd-server etcd-client >/dev/null; }; }

proto: venv
	$(BIN)/python -m grpc_tools.protoc -Iproto=proto --python_out=. --grpc_python_out=. --pyi_out=. proto/tidemark.proto

demo: venv sysdeps
	$(BIN)/tidemark demo

lint: venv
	$(BIN)/ruff check .
	$(BIN)/mypy broker replication tieredstore spark_connector
	$(BIN)/lint-imports

test: venv sysdeps lint
	$(BIN)/python -m pytest -q tests

bench: venv sysdeps
	$(BIN)/python bench/run_all.py

# A long chaos run (tests/chaos): DURATION=30m by default, SEED=<n> to replay one; the slow tests first.
DURATION ?= 30m
chaos: venv sysdeps
	$(BIN)/python -m pytest -q tests -m slow
	$(BIN)/python -m tests.chaos.run --duration $(DURATION) $(if $(SEED),--seed $(SEED),)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

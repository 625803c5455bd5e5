# Everything installs itself: `make demo` and `make test` work on a fresh Debian machine with
# Python 3.11 and Java 17.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint proto bench chaos clean venv sysdeps buildtools

venv: $(STAMP)

$(STAMP): requirements.lock pyproject.toml $(wildcard broker/logformat/*.c broker/logformat/*.h)
	@command -v $(PY) >/dev/null || { echo "need $(PY)"; exit 1; }
	@$(MAKE) --no-print-directory buildtools
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --no-cache-dir -r requirements.lock
	rm -f broker/logformat/_*.so  # a failed build must not leave an old module in place
	$(BIN)/pip install --quiet --no-deps --no-build-isolation -e .
	@$(BIN)/python -c 'import broker.logformat._framing, broker.logformat._plainwire' 2>/dev/null || \
	  echo "warning: broker/logformat/*.c did not build: the framing walk and plain messages stay in Python (make test fails on it)"
	touch $(STAMP)

# A C compiler and Python's headers build the send path's framing walk (broker/logformat/_framing.c).
# Without them the install still succeeds, the Python walk runs, and the test of the build fails.
HAVE_HEADERS = $(PY) -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))'
buildtools:
	@command -v gcc >/dev/null && $(HAVE_HEADERS) || { $(call APT_INSTALL,gcc $(notdir $(PY))-dev) || \
	  echo "warning: could not install gcc and $(notdir $(PY))-dev: the framing walk stays in Python"; }

# Install Debian packages $(1), updating the package lists only when the first try fails.
APT_INSTALL = { export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -q --no-install-recommends $(1) >/dev/null 2>&1 || \
	  { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends $(1) >/dev/null; }; }

# Debian packages the demo and the tests run for real: etcd (the coordinator). The tests install
# radosgw and prometheus themselves when they first need them (tests/aptutil.py).
sysdeps:
	@command -v etcd >/dev/null && command -v etcdctl >/dev/null || $(call APT_INSTALL,etcd-server etcd-client)

proto: venv
	$(BIN)/python -m grpc_tools.protoc -Iproto=proto --python_out=. --grpc_python_out=. --pyi_out=. proto/tidemark.proto

demo: venv sysdeps
	$(BIN)/tidemark demo

lint: venv
	$(BIN)/ruff check .
	$(BIN)/mypy broker replication tieredstore spark_connector
	$(BIN)/lint-imports

# Two pytest-xdist workers: most tests wait on daemons, etcd and failovers, not on a core (one
# worker took 36-40 min on 2 cores). The chaos runs share one worker (xdist_group "chaos").
TEST_WORKERS ?= 2
test: venv sysdeps lint
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup tests

# perf (Debian's linux-perf) for bench/send_profile.py's stacks; the benchmarks run without it too
bench: venv sysdeps
	@command -v perf >/dev/null || $(call APT_INSTALL,linux-perf) || echo "warning: no perf: send_profile prints no stacks"
	$(BIN)/python bench/run_all.py

# A long chaos run (tests/chaos): DURATION=30m by default, SEED=<n> to replay one, SHARDS=2 for two
# pairs as two shards of one cluster; the slow tests first.
DURATION ?= 30m
chaos: venv sysdeps
	$(BIN)/python -m pytest -q tests -m slow
	$(BIN)/python -m tests.chaos.run --duration $(DURATION) $(if $(SEED),--seed $(SEED),) $(if $(SHARDS),--shards $(SHARDS),)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache broker/logformat/_*.so

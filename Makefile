# Everything installs itself: `make demo` and `make test` work on a fresh Debian machine with
# Python 3.11 and Java 17.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint proto bench chaos clean venv

venv: $(STAMP)

$(STAMP): requirements.lock pyproject.toml
	@command -v $(PY) >/dev/null || { echo "need $(PY)"; exit 1; }
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --no-cache-dir -r requirements.lock
	$(BIN)/pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

proto: venv
	$(BIN)/python -m grpc_tools.protoc -Iproto=proto --python_out=. --grpc_python_out=. --pyi_out=. proto/tidemark.proto

demo: venv
	$(BIN)/tidemark demo

lint: venv
	$(BIN)/ruff check .
	$(BIN)/mypy broker replication tieredstore spark_connector
	$(BIN)/lint-imports

test: venv lint
	$(BIN)/python -m pytest -q tests

bench: venv
	$(BIN)/python bench/run_all.py

chaos: venv
	$(BIN)/python -m pytest -q tests -m slow

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

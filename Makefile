# The two commands a newcomer needs: `make run` and `make test`.
# Both create .venv with everything they need from pip (no root, no Docker).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: run test test-all test-interpreter install protos lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/kvmesh up --demo

# Test files run on PYTEST_WORKERS processes (pytest-xdist; 0: one process). A whole file goes
# to one worker, so a module's shared mesh or cluster is started once; the suite waits on real
# processes (SeaweedFS, Valkey, services starting) much of the time, so two workers on two
# cores finish well before one.
PYTEST_WORKERS ?= 2

test: $(STAMP)
	$(BIN)/python -m pytest -m "not slow and not gpu and not interpreter" -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# the engine on Triton kernels under the CPU interpreter vs the torch kernels (minutes)
test-interpreter: $(STAMP)
	$(BIN)/python -m pytest -m interpreter tests/kernels $(PYTEST_ARGS)

test-all: $(STAMP)
	$(BIN)/python -m pytest -m "not gpu" $(PYTEST_ARGS)

protos: $(STAMP)
	$(BIN)/python scripts/gen_protos.py

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .kvmesh

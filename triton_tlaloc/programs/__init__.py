"""Programs that are not language models (docs/design.md#programs-that-are-not-language-models).

    generic.py  any StableHLO program: bindings, shape specialization, ProgramRuntime, run_batch
    bounded.py  bounded programs (tlaloc-bounded-v1): export with a padding check, BoundedRuntime
    model.py    their TritonPythonModel (bounded or generic mode)
"""

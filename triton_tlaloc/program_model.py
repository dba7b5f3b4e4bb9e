"""The name repositories written before the package was grouped by concern import: their
`model.py` shim says `from triton_tlaloc.program_model import TritonPythonModel`. The model is
triton_tlaloc.programs.model; new repositories import it from there."""

from .programs.model import TritonPythonModel  # noqa: F401

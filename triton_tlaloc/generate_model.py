"""The name repositories written before the package was grouped by concern import: their
`model.py` shim says `from triton_tlaloc.generate_model import TritonPythonModel`. The model is
triton_tlaloc.triton.generate_model; new repositories import it from there."""

from .triton.generate_model import TritonPythonModel  # noqa: F401

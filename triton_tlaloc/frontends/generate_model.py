"""The path repositories written while the generate model lived in frontends/ import: their
`model.py` shim says `from triton_tlaloc.frontends.generate_model import TritonPythonModel`. The
model is triton_tlaloc.triton.generate_model; new repositories import it from there."""

from ..triton.generate_model import TritonPythonModel  # noqa: F401

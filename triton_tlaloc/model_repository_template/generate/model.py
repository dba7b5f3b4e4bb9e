# Written by `tlaloc repository`: the generate model is triton_tlaloc.triton.generate_model,
# imported from the Python environment the backend stub runs in.
from triton_tlaloc.triton.generate_model import TritonPythonModel  # noqa: F401

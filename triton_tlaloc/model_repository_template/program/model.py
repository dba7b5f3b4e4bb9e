# Written by `tlaloc repository`: a bounded or generic StableHLO program, served by
# triton_tlaloc.program_model from the Python environment the backend stub runs in.
from triton_tlaloc.program_model import TritonPythonModel  # noqa: F401

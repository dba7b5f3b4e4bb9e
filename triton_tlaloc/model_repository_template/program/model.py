# Written by `tlaloc repository`: a bounded or generic StableHLO program, served by
# triton_tlaloc.programs.model from the Python environment the backend stub runs in.
from triton_tlaloc.programs.model import TritonPythonModel  # noqa: F401

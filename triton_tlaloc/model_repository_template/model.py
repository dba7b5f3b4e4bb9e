# Written by `tlaloc repository`: the model is triton_tlaloc.model, imported from the Python
# environment the backend stub runs in (the first python3 on PATH, or EXECUTION_ENV_PATH).
from triton_tlaloc.model import TritonPythonModel  # noqa: F401

"""An old path, kept for imports written before the package was grouped by concern: this module
is triton_tlaloc.programs.bounded itself (or import the names from triton_tlaloc)."""

import importlib
import sys

sys.modules[__name__] = importlib.import_module(".programs.bounded", __package__)

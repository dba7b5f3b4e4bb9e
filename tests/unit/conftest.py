"""The unit tests run with no JAX, no torch and no Triton in the process: an import of any of them
raises here, so a pure-Python part that starts to need one fails its tests at once.

They run in a process of their own (`make unit`, or tests/test_unit_suite.py under `make
test`): the rest of the suite imports JAX and torch, and an import guard cannot take back a
module already imported.
"""

from __future__ import annotations

import importlib.abc
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

BANNED = ("jax", "jaxlib", "torch", "transformers", "triton_python_backend_utils",
          "tritonclient")


class ImportGuard(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BANNED:
            raise ImportError(f"the unit tests must not import {name} (tests/unit/conftest.py)")
        return None


already = sorted(m for m in sys.modules if m.split(".")[0] in BANNED)
if already:
    raise RuntimeError(f"tests/unit runs in a process of its own, without {', '.join(already)} "
                       f"already imported: `make unit` or `pytest tests/unit`")
sys.meta_path.insert(0, ImportGuard())


@pytest.fixture
def private_tmp(monkeypatch):
    """A fresh directory made the process's temporary directory, where the generation link puts
    its sockets. Not pytest's tmp_path: a Unix socket's path is at most 107 bytes, and under
    pytest-xdist tmp_path's is longer."""
    path = tempfile.mkdtemp(prefix="tlaloc-unit-")
    monkeypatch.setattr(tempfile, "tempdir", path)
    yield Path(path)
    shutil.rmtree(path, ignore_errors=True)

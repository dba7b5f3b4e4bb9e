"""The package's modules import only each other's public names, and this process runs under the
import guard (tests/unit/conftest.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import triton_tlaloc

PACKAGE = Path(triton_tlaloc.__file__).parent


def private_imports(path: Path) -> list[str]:
    """`from <a triton_tlaloc module> import _name` in one file: a private name of another module,
    which ties the importer to that module's insides (the program model once imported the
    sequence model's helpers, and with them the batcher, the engine and the runtime)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom):
            continue
        internal = node.level > 0 or (node.module or "").startswith("triton_tlaloc")
        for alias in node.names:
            if internal and alias.name.startswith("_") and alias.name != "__future__":
                found.append(f"{path.name}:{node.lineno} imports "
                             f"{alias.name} from {'.' * node.level}{node.module or ''}")
    return found


def test_no_module_imports_a_private_name_from_another():
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) > 30
    offences = [line for path in modules for line in private_imports(path)]
    assert offences == []


def test_the_check_finds_a_private_import(tmp_path):
    """Negative control: the check is not vacuous."""
    bad = tmp_path / "probe.py"
    bad.write_text("from .model import _Reply\nfrom triton_tlaloc.batcher import _Job\n"
                   "from os import _exit\n")
    assert private_imports(bad) == ["probe.py:1 imports _Reply from .model",
                                    "probe.py:2 imports _Job from triton_tlaloc.batcher"]


@pytest.mark.parametrize("module", ["jax", "torch", "triton_python_backend_utils",
                                    "tritonclient.grpc"])
def test_the_import_guard_refuses_frameworks(module):
    with pytest.raises(ImportError, match="unit tests must not import"):
        __import__(module)

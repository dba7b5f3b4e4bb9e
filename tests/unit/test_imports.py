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


# The serving core: what neither Triton's glue nor a front end nor the command may be imported
# by, so that a second runtime (no framework, under vLLM) can take the core without them.
CORE = ("pages.py", "batcher.py", "codes.py", "model_parameters.py", "kv", "engine",
        "scheduling", "generation", "runtime", "artifact")
EDGE = ("triton", "frontends", "cli", "model")


def imported_packages(source: str, package: list[str]) -> set[str]:
    """The first name under triton_tlaloc (a subpackage or a top-level module) of everything
    `source`, a module of `package` (["triton_tlaloc", "engine"]), imports."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names
                         if a.name.startswith("triton_tlaloc."))
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            full = base + [p for p in (node.module or "").split(".") if p]
            if full[:1] == ["triton_tlaloc"]:
                found.update([full[1]] if len(full) > 1 else [a.name for a in node.names])
    return found


def edge_imports(path: Path) -> list[str]:
    package = list(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    return sorted(imported_packages(path.read_text(), package) & set(EDGE))


def test_the_core_imports_no_triton_glue_front_end_or_command():
    files = sorted(p for name in CORE for p in ([PACKAGE / name] if name.endswith(".py")
                                                  else (PACKAGE / name).rglob("*.py")))
    assert len(files) > 30
    offences = [f"{p.relative_to(PACKAGE)} imports {edge_imports(p)}"
                for p in files if edge_imports(p)]
    assert offences == []


def test_the_layering_check_finds_an_edge_import():
    """Negative control: a core module importing Triton's glue relatively, a front end
    absolutely and the sequence model from the top level."""
    source = ("from ..triton.outputs import small_outputs\n"
              "from triton_tlaloc.frontends import client\nfrom .steps import Row\n"
              "from .. import model\nimport triton_tlaloc.cli\n")
    assert imported_packages(source, ["triton_tlaloc", "engine"]) == {
        "triton", "frontends", "engine", "model", "cli"}

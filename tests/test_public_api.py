"""The imports users write keep working: every name of the public API (`triton_tlaloc.__all__`)
imports, every import and every `triton_tlaloc.…` path README.md and docs/ show resolves, and the
old module paths are the modules they moved to. Control: a path that does not exist fails the
same check."""

from __future__ import annotations

import importlib
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

import triton_tlaloc

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# `from triton_tlaloc.x import a, b` on one line, or `import (a,\n b)` over several
FROM_IMPORT = re.compile(r"^\s*from (triton_tlaloc[\w.]*) import (?:\(([\w,\s]+)\)|([\w, ]+))",
                         re.M)
IMPORT = re.compile(r"^\s*import (triton_tlaloc[\w.]*)", re.M)
DOTTED = re.compile(r"\btriton_tlaloc(?:\.\w+)+")


def resolve(path: str):
    """The module or attribute a dotted path names: its longest importable module prefix, then
    attributes; raises ImportError or AttributeError when it names nothing. A model module
    imports Triton's Python-backend utilities, which exist only in a model's process: there the
    module's file is what is checked."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name == "triton_python_backend_utils":
                return importlib.util.find_spec(module)
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(path)


def shown_paths() -> set[str]:
    """Every triton_tlaloc path the docs show, as modules or module.name."""
    paths = set()
    for doc in DOCS:
        text = doc.read_text()
        for module, *names in FROM_IMPORT.findall(text):
            paths |= {f"{module}.{n.strip()}" for n in "".join(names).split(",") if n.strip()}
        paths |= set(IMPORT.findall(text))
        # A file name like `triton_tlaloc.model.py`'s last part is not a name
        paths |= {p for p in DOTTED.findall(text) if not p.endswith((".py", ".md"))}
    return paths


def test_every_public_name_imports_from_the_package_without_jax_until_used():
    out = subprocess.run([sys.executable, "-c", (
        "import sys, triton_tlaloc; from triton_tlaloc import TlalocClient, TritonServer; "
        "print('jax' in sys.modules)")], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    for name in triton_tlaloc.__all__:
        assert getattr(triton_tlaloc, name) is not None
    from triton_tlaloc import export_artifact, write_repository  # noqa: F401
    with pytest.raises(AttributeError):
        triton_tlaloc.no_such_name  # noqa: B018


def test_every_path_the_docs_show_resolves():
    paths = shown_paths()
    assert {"triton_tlaloc.TritonServer", "triton_tlaloc.export_program"} <= paths
    missing = []
    for path in sorted(paths):
        try:
            resolve(path)
        except (ImportError, AttributeError) as e:
            missing.append(f"{path}: {type(e).__name__}: {e}")
    assert not missing, "\n".join(missing)
    for wrong in ("triton_tlaloc.nowhere.thing", "triton_tlaloc.triton.server.NoServer"):  # control
        with pytest.raises((ImportError, AttributeError)):
            resolve(wrong)


def test_old_module_paths_are_the_modules_they_moved_to():
    import triton_tlaloc.bounded
    import triton_tlaloc.client
    import triton_tlaloc.frontends.client
    import triton_tlaloc.programs.bounded

    assert triton_tlaloc.client is triton_tlaloc.frontends.client
    assert triton_tlaloc.bounded is triton_tlaloc.programs.bounded
    from triton_tlaloc.client import TlalocClient, generate  # noqa: F401
    for shim in ("triton_tlaloc.generate_model", "triton_tlaloc.program_model"):
        assert "TritonPythonModel" in Path(importlib.util.find_spec(shim).origin).read_text()

"""Every script and check module is valid Python: nothing runs scripts/ in the suite, and a
rename once left six of them (verify.py among them) with an import cut in half. Compiled, not
imported: no script's imports run here. Control: a cut import fails the same compile."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FILES = sorted([*ROOT.glob("scripts/*.py"), *ROOT.glob("checks/*.py")])


def test_every_script_and_check_compiles():
    assert len(FILES) > 30
    for path in FILES:
        compile(path.read_text(), str(path), "exec")
    with pytest.raises(SyntaxError):  # the control: the cut import
        compile("from triton_tlaloc.export.gguf_checkpoint import \n", "cut.py", "exec")

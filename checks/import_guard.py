"""A command run with some top-level modules barred from import: `python -m checks.import_guard
jax,jaxlib,torch run ART ...` runs `tlaloc run ART ...` in a process where importing any of
them raises (and none is imported before), so a path that needs one fails at once. After the
command, the modules the process holds are checked again and the barred ones named."""

from __future__ import annotations

import importlib.abc
import sys


class ImportGuard(importlib.abc.MetaPathFinder):
    def __init__(self, banned: set[str]):
        self.banned = banned

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.banned:
            raise ImportError(f"{name}: barred from this process (checks/import_guard.py)")
        return None


def main(argv: list[str]) -> int:
    banned = set(argv[0].split(","))
    held = sorted(m for m in sys.modules if m.split(".")[0] in banned)
    assert not held, f"imported before the guard: {held}"
    sys.meta_path.insert(0, ImportGuard(banned))
    from triton_tlaloc.cli import main as tlaloc

    code = tlaloc(argv[1:])
    held = sorted({m.split(".")[0] for m in sys.modules} & banned)
    if held:
        print(f"barred modules imported: {held}", file=sys.stderr)
        return 3
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

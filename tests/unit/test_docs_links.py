"""The docs keep their promises: every link to a heading (`design.md#donation`, `(#kv-reuse)`,
`docs/design.md#donation` in a comment, `design.md, "Quantization"`) names a heading of that
file, by GitHub's anchor rule; every module of triton_tlaloc/ has its line in
docs/architecture.md's layout and its row in the ownership table; README.md stays a front door
of at most 320 lines. Controls: a made-up anchor, a made-up heading and a made-up module are
reported by the same functions.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve()
README_MAX_LINES = 320

HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")
# `design.md#donation`, `../README.md#kv-reuse`, `docs/design.md#the-layer-loop`
FILE_ANCHOR = re.compile(r"(?<![\w/.-])((?:\.\./)?(?:[\w-]+/)*[\w-]+\.md)#([\w-]+)")
# `(#kv-reuse)`: a heading of the same file
SAME_FILE_ANCHOR = re.compile(r"\(#([\w-]+)\)")
# `design.md, "Quantization"` or `README.md ("Model parameters")`: a heading by its text
QUOTED_HEADING = re.compile(
    r"(?<![\w/.-])((?:\.\./)?(?:[\w-]+/)*[\w-]+\.md)(?:,| \()\s*\"([^\"]+)\"")


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading's text: a markdown link reduced to its text, lowercased,
    everything but letters, digits, spaces, hyphens and underscores dropped, each space a
    hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # [text](url) -> text
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def headings(path: Path) -> list[str]:
    """The text of every heading of a markdown file, in order; lines inside fenced code blocks
    are not headings."""
    found, fenced = [], False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced and (m := HEADING.match(line)):
            found.append(m.group(2))
    return found


def anchors(path: Path) -> set[str]:
    """Every anchor a link may name in a markdown file: each heading's, with -1, -2 ... for a
    heading's second, third ... occurrence."""
    seen: dict[str, int] = {}
    result = set()
    for text in headings(path):
        base = anchor(text)
        n = seen.get(base, 0)
        result.add(base if n == 0 else f"{base}-{n}")
        seen[base] = n + 1
    return result


def target(source: Path, name: str) -> Path | None:
    """The markdown file a link or mention in `source` names: relative to the source's folder
    (a link in docs/), else to the repository root (`docs/design.md` in a comment), else to
    docs/ (a table row written in Python for docs/parameters.md)."""
    for base in (source.parent, ROOT, ROOT / "docs"):
        path = (base / name).resolve()
        if path.is_file():
            return path
    return None


def broken_links(source: Path, text: str | None = None) -> list[str]:
    """Every link or mention in `source` (or in `text`, read as if it were that file's) whose
    file or heading does not exist, as 'source: link (why)'."""
    text = source.read_text() if text is None else text
    where = source.relative_to(ROOT) if source.is_relative_to(ROOT) else source
    broken = []
    for name, frag in FILE_ANCHOR.findall(text):
        path = target(source, name)
        if path is None:
            broken.append(f"{where}: {name}#{frag} (no such file)")
        elif frag not in anchors(path):
            broken.append(f"{where}: {name}#{frag} (no such heading in {path.relative_to(ROOT)})")
    if source.suffix == ".md":
        for frag in SAME_FILE_ANCHOR.findall(text):
            if frag not in anchors(source):
                broken.append(f"{where}: #{frag} (no such heading in this file)")
    for name, quoted in QUOTED_HEADING.findall(text):
        path = target(source, name)
        quoted = " ".join(quoted.split())
        if path is None:
            broken.append(f'{where}: {name}, "{quoted}" (no such file)')
        elif anchor(quoted) not in anchors(path):
            broken.append(f'{where}: {name}, "{quoted}" (no such heading in '
                          f"{path.relative_to(ROOT)})")
    return broken


def sources() -> list[Path]:
    """The files whose links are checked: the markdown docs, and the code, scripts, tests and
    deployment files that cite them."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    files += sorted(p for p in (ROOT / "triton_tlaloc").rglob("*")
                    if p.suffix in (".py", ".in") and "__pycache__" not in p.parts)
    files += sorted(p for p in (ROOT / "scripts").glob("*") if p.suffix in (".py", ".sh"))
    files += sorted(p for d in ("tests", "checks") for p in (ROOT / d).rglob("*.py")
                    if "__pycache__" not in p.parts and p.resolve() != HERE)
    files += sorted(p for p in (ROOT / "deploy").rglob("*") if p.is_file())
    files += [ROOT / "Makefile"]
    return [p for p in files if p.is_file()]


def modules() -> list[str]:
    """Every module of triton_tlaloc/, relative to it (`export/writer.py`); a subpackage's
    __init__.py is its folder's and is left out."""
    package = ROOT / "triton_tlaloc"
    return sorted(str(p.relative_to(package)) for p in package.rglob("*.py")
                  if "__pycache__" not in p.parts
                  and (p.name != "__init__.py" or p.parent == package))


def section(text: str, title: str) -> str:
    """The text under a `## title` heading, up to the next heading of that level."""
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else len(text)]


def layout_modules(architecture: str) -> set[str]:
    """The paths the layout block names, `export/writer.py` for a file under `export/`: each
    line starts with one or more names (`client.py, bounded.py`), indented two spaces a folder."""
    block = section(architecture, "Layout, one line per module").split("```")[1]
    named, folders = set(), {}  # indent -> folder path
    for line in block.splitlines():
        m = re.match(r"^( *)([\w./]+(?:, [\w./]+)*)", line)
        if not m:
            continue
        indent = len(m.group(1))
        folders = {i: f for i, f in folders.items() if i < indent}
        parent = folders[max(folders)] if folders else ""
        for name in m.group(2).split(", "):
            path = parent + name
            if path.endswith("/"):
                folders[indent] = path
            else:
                named.add(path)
    prefix = "triton_tlaloc/"
    return {p[len(prefix):] for p in named if p.startswith(prefix)}


def owned_modules(architecture: str) -> set[str]:
    """The modules the ownership table's first column names (`client.py`, `bounded.py`)."""
    named = set()
    for line in section(architecture, "Who owns what").splitlines():
        if line.startswith("| `"):
            named |= set(re.findall(r"`([\w./]+\.py)`", line.split("|")[1]))
    return named


def missing_modules(architecture: str, names: list[str]) -> list[str]:
    """The modules docs/architecture.md leaves out of its layout or its ownership table."""
    layout, owned = layout_modules(architecture), owned_modules(architecture)
    missing = [f"{m}: not in the layout block" for m in names if m not in layout]
    missing += [f"{m}: not in the ownership table" for m in names if m not in owned]
    return missing


def test_every_link_to_a_heading_resolves():
    files = sources()
    assert ROOT / "docs" / "serving.md" in files
    assert ROOT / "triton_tlaloc" / "runtime" / "core.py" in files
    broken = [b for path in files for b in broken_links(path)]
    assert not broken, "links to headings that do not exist:\n" + "\n".join(broken)


def test_a_made_up_anchor_or_heading_is_reported():  # the control
    readme = ROOT / "README.md"
    made_up = ("[x](docs/design.md#no-such-heading) (#no-such-heading) "
               'docs/no-such-file.md#donation (docs/design.md, "No such heading")')
    assert broken_links(readme, made_up) == [
        "README.md: docs/design.md#no-such-heading (no such heading in docs/design.md)",
        "README.md: docs/no-such-file.md#donation (no such file)",
        "README.md: #no-such-heading (no such heading in this file)",
        'README.md: docs/design.md, "No such heading" (no such heading in docs/design.md)']
    assert broken_links(readme, "[x](docs/design.md#donation) docs/design.md#the-layer-loop "
                                '(docs/design.md, "Donation")') == []


def test_anchors_follow_githubs_rule(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("# Notes\n## Notes\n```sh\n# Notes: a comment, not a heading\n```\n## Notes\n")
    assert anchors(doc) == {"notes", "notes-1", "notes-2"}
    assert anchor("The host tier: swapping instead of refusing") == \
        "the-host-tier-swapping-instead-of-refusing"
    assert anchor("`scripts/verify.sh`") == "scriptsverifysh"
    assert anchor("Metrics (Triton's metrics port, labels `model` and `instance`)") == \
        "metrics-tritons-metrics-port-labels-model-and-instance"
    assert anchor("5. Quantized weights") == "5-quantized-weights"
    assert anchor("`model_parameters.py` and [KV reuse](serving.md#kv-reuse)") == \
        "model_parameterspy-and-kv-reuse"


def test_every_module_is_in_the_architecture_doc():
    architecture = (ROOT / "docs" / "architecture.md").read_text()
    names = modules()
    assert "__init__.py" in names and "export/writer.py" in names
    missing = missing_modules(architecture, names)
    assert not missing, "modules docs/architecture.md does not name:\n" + "\n".join(missing)
    # The control: a module nobody described is caught
    assert missing_modules(architecture, ["no_such_module.py"]) == [
        "no_such_module.py: not in the layout block",
        "no_such_module.py: not in the ownership table"]


def test_the_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"
    assert "## The two set-up commands" in lines

"""The loader refuses a corrupted artifact with a message naming the problem and the file."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from triton_tlaloc.artifact.loading import load_artifact
from triton_tlaloc.artifact.manifest import MANIFEST_NAME, ArtifactError


@pytest.fixture
def artifact_copy(tiny, tmp_path) -> Path:
    src = tiny.artifact("llama", False, batch_ladder=(1,), context_ladder=(32,))
    dst = tmp_path / "art"
    shutil.copytree(src, dst)
    return dst


def edit_manifest(art: Path, fn) -> None:
    m = json.loads((art / MANIFEST_NAME).read_text())
    fn(m)
    (art / MANIFEST_NAME).write_text(json.dumps(m))


def first_entry(art: Path) -> dict:
    return json.loads((art / MANIFEST_NAME).read_text())["entries"][0]


def test_the_intact_copy_loads(artifact_copy):
    art = load_artifact(artifact_copy)
    assert set(art.entries) == {"decode_b1_c32", "prefill_b1_c32"}


@pytest.mark.parametrize("schema,message", [
    ("tlaloc-serving-v9", "unknown schema version 'tlaloc-serving-v9'"),
    ("tlaloc-serving-v3", "schema tlaloc-serving-v3 needs model.windowedKv"),
    ("tlaloc-serving-v4", "schema tlaloc-serving-v4 needs model.linearState"),
    ("tlaloc-bounded-v1", "schema tlaloc-bounded-v1 is refused: a bounded program is not a"),
])
def test_schema_versions_refused_by_name(artifact_copy, schema, message):
    """Unknown and unbuilt schemas by name; a v2 artifact relabelled v3 (no windowed pool) or
    v4 (no state pools)."""
    edit_manifest(artifact_copy, lambda m: m.update(schema=schema))
    with pytest.raises(ArtifactError, match=re.escape(message)) as e:
        load_artifact(artifact_copy)
    assert MANIFEST_NAME in str(e.value)


def test_missing_weight_file(artifact_copy):
    victim = sorted((artifact_copy / "weights").iterdir())[3]
    victim.unlink()
    with pytest.raises(ArtifactError, match=f"file is missing .*{re.escape(victim.name)}"):
        load_artifact(artifact_copy)


def test_missing_body(artifact_copy):
    body = artifact_copy / first_entry(artifact_copy)["body"]
    body.unlink()
    with pytest.raises(ArtifactError, match=f"entry decode_b1_c32: file is missing .*{body.name}"):
        load_artifact(artifact_copy)


def test_body_whose_sha256_differs(artifact_copy):
    body = artifact_copy / first_entry(artifact_copy)["body"]
    body.write_text(body.read_text() + "\n// edited\n")
    with pytest.raises(ArtifactError, match=f"body sha256 .* differs from the manifest's .*{body.name}"):
        load_artifact(artifact_copy)


def test_weight_file_whose_byte_length_differs(artifact_copy):
    victim = sorted((artifact_copy / "weights").iterdir())[0]
    victim.write_bytes(victim.read_bytes()[:-4])
    with pytest.raises(ArtifactError, match=f"file holds \\d+ bytes, the manifest says .*{victim.name}"):
        load_artifact(artifact_copy)


def test_body_whose_main_signature_differs_from_its_program(artifact_copy):
    """The body re-hashed so only the signature check can catch it: token_ids 1x1 -> 1x2."""
    entry = first_entry(artifact_copy)
    body = artifact_copy / entry["body"]
    text = body.read_text().replace("%arg0: tensor<1x1xi32>", "%arg0: tensor<1x2xi32>", 1)
    body.write_text(text)
    sha = hashlib.sha256(text.encode()).hexdigest()
    edit_manifest(artifact_copy, lambda m: m["entries"][0].update(sha256=sha))
    with pytest.raises(ArtifactError, match=r"@main signature differs from the program: "
                                            r"parameter 0 \(token_ids\) is tensor<1x2xi32>"):
        load_artifact(artifact_copy)


def test_donation_pair_whose_shapes_differ(artifact_copy):
    prog_path = artifact_copy / first_entry(artifact_copy)["program"]
    prog = json.loads(prog_path.read_text())
    prog["donation"][0]["output"] = 0  # the logits paired with a KV pool input
    prog_path.write_text(json.dumps(prog))
    with pytest.raises(ArtifactError, match=f"donation pair output logits .* differ in shape or "
                                            f"dtype .*{prog_path.name}"):
        load_artifact(artifact_copy)


def test_donation_pair_whose_dtypes_differ(artifact_copy):
    prog_path = artifact_copy / first_entry(artifact_copy)["program"]
    prog = json.loads(prog_path.read_text())
    out_index = prog["donation"][0]["output"]
    prog["outputs"][out_index]["dtype"] = "bf16"
    prog_path.write_text(json.dumps(prog))
    with pytest.raises(ArtifactError, match="differ in shape or dtype"):
        load_artifact(artifact_copy)


def take_weight_as(prog_path: Path, slot: str, dtype: str) -> None:
    """The program at prog_path taking weight `slot` as `dtype`."""
    prog = json.loads(prog_path.read_text())
    next(s for s in prog["inputs"] if s.get("slot") == slot)["dtype"] = dtype
    prog_path.write_text(json.dumps(prog))


def test_weight_taken_as_a_type_that_is_not_its_bits(artifact_copy):
    """An f32 weight has no bits form: a program taking it as ui16 is refused."""
    take_weight_as(artifact_copy / first_entry(artifact_copy)["program"], "layers.qkv", "ui16")
    with pytest.raises(ArtifactError, match="weight slot layers.qkv is f32 .* in the weight table "
                                            "but ui16"):
        load_artifact(artifact_copy)


def test_entries_that_take_a_weight_differently(tiny, tmp_path):
    """A bf16 loop artifact's stacked weights are taken as their bits (ui16) by every entry; one
    entry taking a slot as bf16 is refused, since one buffer on the device serves all."""
    src = tiny.artifact("llama", False, "bf16", batch_ladder=(1,), context_ladder=(32,))
    art = tmp_path / "art"
    shutil.copytree(src, art)
    assert load_artifact(art).weight_input_dtypes()["layers.qkv"] == "ui16"
    second = json.loads((art / MANIFEST_NAME).read_text())["entries"][1]
    take_weight_as(art / second["program"], "layers.qkv", "bf16")
    with pytest.raises(ArtifactError, match="layers.qkv is bf16 in the program but ui16 in an "
                                            "earlier entry's"):
        load_artifact(art)


def test_cli_reports_a_refusal_without_a_traceback(artifact_copy):
    edit_manifest(artifact_copy, lambda m: m.update(schema="tlaloc-bounded-v1"))
    proc = subprocess.run([sys.executable, "-m", "triton_tlaloc.cli", "run", str(artifact_copy),
                           "--prompt-ids", "1,2,3"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "schema tlaloc-bounded-v1 is refused" in proc.stderr
    assert "Traceback" not in proc.stderr

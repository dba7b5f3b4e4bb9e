"""Verify entries (speculative decoding): a call feeds each sequence its next token and draft
tokens, right-aligned like prefill, and returns the argmax and the logits after every position.

Checked here: the manifest and programs the exporter writes for them; a real verify call after
a prefill against transformers' logits for the same whole sequence, at every position, within
the parity tolerance, with a control (the logits one position off fail it); the loader's
refusals; decode and prefill bodies byte for byte the same with and without verify entries;
no verify entry for a linear-attention model; a verify entry never copies its pools."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from checks.oracle import load_reference, logits_error

from triton_tlaloc.cli import build_parser
from triton_tlaloc.runtime.compiling import compile_order, first_entries
from triton_tlaloc.export import ExportError, ExportOptions
from triton_tlaloc.artifact.loading import load_artifact
from triton_tlaloc.artifact.manifest import (MANIFEST_NAME, POSITION_ARGMAX, POSITION_LOGITS,
                                             ArtifactError)
from triton_tlaloc.runtime.core import Runtime, StepInputError
from triton_tlaloc.artifact.stablehlo import parse_main_signature
from triton_tlaloc.engine.steps import Row, build_step

VERIFY = (3, 5, 9)
# Largest |difference| over the largest |logit| (at least 1), as tests/test_parity.py states it.
TOLERANCE = {"f32": 1e-4, "bf16": 1e-3}
PROMPT_A = [1, 17, 99, 3, 200, 41, 7, 88, 150, 12, 5, 230, 64, 9, 101, 33, 2, 77, 180, 45]
PROMPT_B = [1, 64, 9, 101, 33, 250, 8, 19, 140, 77, 3]
DRAFT_FILLER = [(i * 37 + 11) % 240 + 10 for i in range(16)]  # drafts a model rejects


@pytest.fixture(scope="module")
def verify_art(tiny) -> Path:
    return tiny.artifact("llama", False, verify_tokens=VERIFY)


def test_verify_entries_in_the_manifest_and_programs(verify_art):
    art = load_artifact(verify_art)
    assert art.verify_tokens == VERIFY
    assert art.manifest["model"]["verifyTokens"] == list(VERIFY)
    verify = {n for n, e in art.entries.items() if e.kind == "verify"}
    assert verify == {f"verify_b{b}_c{c}_t{t}" for b in (1, 2) for c in (32, 128) for t in VERIFY}
    # the manifest's order: per context, decode, prefill, then verify entries
    kinds = [(e["context"], e["kind"]) for e in art.manifest["entries"]]
    rank = {"decode": 0, "prefill": 1, "verify": 2}
    assert kinds == sorted(kinds, key=lambda ck: (ck[0], rank[ck[1]]))
    entry = art.entries["verify_b2_c32_t5"]
    assert (entry.batch, entry.context, entry.tokens_per_seq) == (2, 32, 5)
    outs = entry.program.outputs
    assert [(o.name, o.role, o.dtype, o.shape) for o in outs[:2]] == [
        ("position_argmax", POSITION_ARGMAX, "i32", (2, 5)),
        ("position_logits", POSITION_LOGITS, "f32", (2, 5, 256))]
    pool_start = next(i for i, s in enumerate(entry.program.inputs) if s.role == "KV_POOL_IN")
    assert entry.program.donation == tuple((2 + j, pool_start + j) for j in range(len(outs) - 2))
    sig = parse_main_signature(art.body_text(entry))
    assert sig.outputs[:2] == ("tensor<2x5xi32>", "tensor<2x5x256xf32>")
    assert sorted(sig.aliases) == sorted(entry.program.donation)
    decode = art.entries["decode_b2_c32"].program.outputs[0]
    assert (decode.role, decode.shape) == ("LOGITS", (2, 256))


def test_verify_entries_are_chosen_by_fields_and_compiled_last(verify_art):
    art = load_artifact(verify_art)
    assert art.smallest_entry("verify", 1, 20, 4).name == "verify_b1_c32_t5"
    assert art.smallest_entry("verify", 2, 100, 9).name == "verify_b2_c128_t9"
    assert art.smallest_entry("verify", 1, 20, 10) is None
    assert art.smallest_entry("decode", 1, 20).name == "decode_b1_c32"
    assert not any(n.startswith("verify") for n in first_entries(art))
    order = compile_order(art, sorted(art.entries))
    kinds = [art.entries[n].kind for n in order]
    assert kinds.index("verify") == len(kinds) - len(VERIFY) * 4, "verify entries come last"
    tail = [(art.entries[n].context, art.entries[n].batch, art.entries[n].tokens_per_seq)
            for n in order if art.entries[n].kind == "verify"]
    assert tail == sorted(tail)


# ------------------------------------------------------------------ a real verify call

def prefill(rt: Runtime, seq: dict) -> np.ndarray:
    """A sequence's prompt through batch-1 prefill entries, in calls a ring holds (a call of n
    tokens from p0 needs min(p0, window - 1) + n positions of it); the last logits."""
    art, bs = rt.artifact, rt.artifact.model.block_size
    w = art.windowed
    prompt, pos, logits = seq["prompt"], 0, None
    while pos < len(prompt):
        room = w.ring_pages * bs - min(pos, w.window - 1) if w else len(prompt)
        n = min(room, len(prompt) - pos)
        entry = art.smallest_entry("prefill", 1, pos + n, n, among=rt.executables)
        logits = rt.run(entry.name, build_step(entry, [row(rt, seq, prompt[pos:pos + n], pos)],
                                               bs, w.ring_pages if w else 0))[0]
        pos += n
    return logits


def row(rt: Runtime, seq: dict, tokens, start: int) -> Row:
    """One sequence's row of a call, with the pages (and ring pages) up to its end."""
    bs = rt.artifact.model.block_size
    blocks = -(-(start + len(tokens)) // bs)
    ring = seq["ring"][:min(blocks, rt.artifact.windowed.ring_pages)] if rt.artifact.windowed \
        else ()
    return Row(tuple(tokens), start, seq["pages"][:blocks], ring)


def reference_logits(ckpt: Path, ids: list[int], bf16: bool) -> np.ndarray:
    """transformers' logits after every position of one sequence, [len(ids), vocab]."""
    model = load_reference(ckpt, bf16_arithmetic=bf16)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


CASES = [("llama", False, "f32"), ("llama", True, "f32"), ("qwen3", True, "bf16"),
         ("gemma3_text", True, "f32")]


@pytest.mark.parametrize("family,tied,weight_dtype", CASES,
                         ids=[f"{f}-{'tied' if t else 'untied'}-{w}" for f, t, w in CASES])
def test_a_verify_call_matches_transformers_at_every_position(tiny, family, tied, weight_dtype):
    """Two sequences prefilled, then one verify call: row A its next token and 8 drafts (the
    whole t9 row), row B its next token and 2 drafts (right-aligned, 6 padding tokens). Every
    position's logits and argmax against transformers on each whole sequence. Heads: untied
    [in, out], tied f32 [hidden, vocab], tied bf16 [vocab, hidden]; gemma3_text's sliding
    layers on rings whose room past the window is exactly 9 tokens."""
    path = tiny.artifact(family, tied, weight_dtype, verify_tokens=(3, 9))
    art = load_artifact(path)
    name = "verify_b2_c32_t9"
    rt = Runtime(art, entries=[name, *(n for n in art.entries if n.startswith("prefill_b1_c32"))])
    seqs = [{"prompt": PROMPT_A, "pages": (1, 2, 3, 4), "ring": (1, 2)},
            {"prompt": PROMPT_B, "pages": (5, 6, 7, 8), "ring": (3, 4)}]
    feeds = []
    for seq, n in zip(seqs, (9, 3)):
        next_token = int(np.argmax(prefill(rt, seq)))
        feeds.append([next_token, *DRAFT_FILLER[:n - 1]])
    entry = art.entries[name]
    ring = art.windowed.ring_pages if art.windowed else 0
    step = build_step(entry, [row(rt, s, f, len(s["prompt"])) for s, f in zip(seqs, feeds)],
                      art.model.block_size, ring)
    argmax_only, none = rt.run_positions(name, step)
    argmax, logits = rt.run_positions(name, step, logits=True)
    assert none is None and argmax.dtype == np.int32 and argmax.shape == (2, 9)
    assert logits.shape == (2, 9, 256) and np.array_equal(argmax_only, argmax)
    assert rt.donation.copied == 0 and rt.donation.in_place >= 2
    tol = TOLERANCE[weight_dtype]
    for r, (seq, feed) in enumerate(zip(seqs, feeds)):
        p, n = len(seq["prompt"]), len(feed)
        want = reference_logits(tiny.checkpoint(family, tied), seq["prompt"] + feed,
                                weight_dtype == "bf16")
        got = logits[r, 9 - n:]
        err = logits_error(got, want[p:p + n])
        shifted = logits_error(got, want[p - 1:p + n - 1])
        print(f"{family} {weight_dtype} row {r}: {n} positions, error {err:.2e}, one position "
              f"off {shifted:.2e} (tolerance {tol:.0e})")
        assert err <= tol
        assert shifted > tol, "control: the logits one position off must fail the tolerance"
        assert argmax[r, 9 - n:].tolist() == np.argmax(want[p:p + n], axis=-1).tolist()
        # the argmax is the logits' own (first of equal maxima)
        assert argmax[r, 9 - n:].tolist() == np.argmax(got, axis=-1).tolist()


def test_run_and_run_positions_refuse_the_other_kind(verify_art):
    rt = Runtime(verify_art, entries=["verify_b1_c32_t3", "decode_b1_c32"])
    entry = rt.artifact.entries["verify_b1_c32_t3"]
    step = build_step(entry, [Row((5, 6, 7), 0, (1,))], 8)
    with pytest.raises(StepInputError, match="verify_b1_c32_t3 is a verify entry: it has no "
                                             "LOGITS output"):
        rt.run("verify_b1_c32_t3", step)
    decode = build_step(rt.artifact.entries["decode_b1_c32"], [Row((5,), 0, (1,))], 8)
    with pytest.raises(StepInputError, match="is a decode entry: it has no POSITION_ARGMAX"):
        rt.run_positions("decode_b1_c32", decode)
    assert rt.donation.runs == 0, "a refused call runs nothing"


def test_a_verify_entry_never_copies_its_pools(tiny):
    """As tests/test_runtime.py checks decode and prefill: the same verify entries at 33 and
    2049 pages need the same temporary bytes (a pool copied inside would add its size)."""
    temps = {}
    for pages in (33, 2049):
        path = tiny.artifact("llama", False, batch_ladder=(2,), context_ladder=(32,),
                             verify_tokens=(3, 9), prefill_tokens=(), num_blocks=pages)
        rt = Runtime(path, entries=["verify_b2_c32_t3", "verify_b2_c32_t9"])
        temps[pages] = {n: ex.get_compiled_memory_stats().temp_size_in_bytes
                        for n, ex in rt.executables.items()}
        pool_bytes = rt.pool_bytes // len(rt.pools)
    assert pool_bytes > 2 * 2**20
    assert temps[2049] == temps[33]


# ------------------------------------------------------------------ the loader's refusals

@pytest.fixture
def verify_copy(tiny, tmp_path) -> Path:
    src = tiny.artifact("llama", False, batch_ladder=(1,), context_ladder=(32,),
                        verify_tokens=(3,))
    dst = tmp_path / "art"
    shutil.copytree(src, dst)
    return dst


def edit_program(art: Path, entry: str, fn) -> Path:
    path = art / "programs" / f"{entry}.json"
    prog = json.loads(path.read_text())
    fn(prog)
    path.write_text(json.dumps(prog))
    return path


def drop_output(prog: dict, index: int) -> None:
    """An output removed, the donation pairs renumbered so that only the removal is wrong."""
    del prog["outputs"][index]
    prog["donation"] = [{"output": d["output"] - (d["output"] > index), "input": d["input"]}
                        for d in prog["donation"]]


def set_output(prog: dict, index: int, **fields) -> None:
    prog["outputs"][index].update(fields)


REFUSALS = {
    "verify without its argmax": (
        "verify_b1_c32_t3", lambda p: drop_output(p, 0),
        "entry verify_b1_c32_t3: a verify entry needs a POSITION_ARGMAX output (i32 [1, 3]); "
        "the program has none"),
    "verify without its logits": (
        "verify_b1_c32_t3", lambda p: drop_output(p, 1),
        "entry verify_b1_c32_t3: a verify entry needs a POSITION_LOGITS output (f32 [1, 3, 256]);"
        " the program has none"),
    "verify logits of the last position only": (
        "verify_b1_c32_t3", lambda p: set_output(p, 1, shape=[1, 256]),
        "entry verify_b1_c32_t3: a verify entry's output 1 must be its only POSITION_LOGITS, "
        "f32 [1, 3, 256]; the program has position_logits f32 [1, 256] at output 1"),
    "verify argmax as f32": (
        "verify_b1_c32_t3", lambda p: set_output(p, 0, dtype="f32"),
        "a verify entry's output 0 must be its only POSITION_ARGMAX, i32 [1, 3]; the program "
        "has position_argmax f32 [1, 3] at output 0"),
    "verify outputs swapped": (
        "verify_b1_c32_t3", lambda p: p["outputs"].insert(0, p["outputs"].pop(1)),
        "a verify entry's output 0 must be its only POSITION_ARGMAX, i32 [1, 3]; the program "
        "has position_argmax i32 [1, 3] at output 1"),
    "decode without logits": (
        "decode_b1_c32", lambda p: drop_output(p, 0),
        "entry decode_b1_c32: a decode entry needs a LOGITS output (f32 [1, 256]); the program "
        "has none"),
    "decode with a position argmax": (
        "decode_b1_c32", lambda p: p["outputs"].insert(1, {
            "name": "position_argmax", "role": POSITION_ARGMAX, "dtype": "i32", "shape": [1, 1]}),
        "entry decode_b1_c32: output position_argmax has role POSITION_ARGMAX, which a decode "
        "entry does not return"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_the_loader_refuses_a_program_without_its_kinds_outputs(verify_copy, case):
    entry, edit, message = REFUSALS[case]
    load_artifact(verify_copy)  # the intact copy loads
    path = edit_program(verify_copy, entry, edit)
    with pytest.raises(ArtifactError, match=re.escape(message)) as e:
        load_artifact(verify_copy)
    assert path.name in str(e.value)


def test_a_prefill_entry_relabelled_verify_is_refused(verify_copy):
    mpath = verify_copy / MANIFEST_NAME
    m = json.loads(mpath.read_text())
    prefill = next(e for e in m["entries"] if e["kind"] == "prefill")
    prefill["kind"] = "verify"
    mpath.write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match=re.escape(
            f"entry {prefill['name']}: a verify entry needs a POSITION_ARGMAX output")):
        load_artifact(verify_copy)
    prefill["kind"] = "speculate"
    mpath.write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match="unknown kind 'speculate'"):
        load_artifact(verify_copy)


# ------------------------------------------------------------------ the exporter's choices

def test_decode_and_prefill_bodies_are_unchanged_by_verify_entries(tiny, verify_art):
    """The verify option adds entries and nothing else: every decode and prefill entry's body
    and program, and every weight file, are the same bytes with and without it."""
    plain_path = tiny.artifact("llama", False)  # no verify entries by default
    plain, verify = load_artifact(plain_path), load_artifact(verify_art)
    assert plain.verify_tokens == () and plain.manifest["model"]["verifyTokens"] == []
    assert set(plain.entries) == {n for n, e in verify.entries.items() if e.kind != "verify"}
    for name, e in plain.entries.items():
        assert verify.entries[name].sha256 == e.sha256, name
        assert ((verify_art / verify.entries[name].program_path).read_bytes()
                == (plain_path / e.program_path).read_bytes()), name
    for a, b in zip(plain.weights, verify.weights, strict=True):
        assert (plain_path / a.file).read_bytes() == (verify_art / b.file).read_bytes(), a.slot
    strip = {**plain.manifest, "entries": None, "model": {**plain.manifest["model"],
                                                          "verifyTokens": None}}
    assert strip == {**verify.manifest, "entries": None,
                     "model": {**verify.manifest["model"], "verifyTokens": None}}


def test_no_verify_entries_for_a_linear_attention_model(tiny, capfd):
    path = tiny.artifact("qwen3_5_text", False, verify_tokens=VERIFY)
    assert "speculative decoding is refused for a model with linear-attention layers" in \
        capfd.readouterr().err
    art = load_artifact(path)
    assert art.verify_tokens == () and art.manifest["model"]["verifyTokens"] == []
    assert {e.kind for e in art.entries.values()} == {"decode", "prefill"}


def test_a_ring_too_small_for_a_verify_call_leaves_it_out(tiny, capfd):
    """gemma3_text, window 8, pages of 4: rings of 3 pages hold 12 - 7 = 5 tokens past the
    window, so the t9 entries are left out."""
    path = tiny.artifact("gemma3_text", True, block_size=4, context_ladder=(32,),
                         batch_ladder=(1,), verify_tokens=VERIFY)
    assert "tokens [9] left out: a ring of 3 pages holds 5 tokens" in capfd.readouterr().err
    assert load_artifact(path).verify_tokens == (3, 5)


@pytest.mark.parametrize("text,want", [("3,5,9", (3, 5, 9)), ("none", ()), ("", ()),
                                       ("4", (4,))])
def test_the_export_command_reads_verify_tokens(text, want):
    args = build_parser().parse_args(["export", "ckpt", "out", "--verify-tokens", text])
    assert args.verify_tokens == want
    assert build_parser().parse_args(["export", "ckpt", "out"]).verify_tokens == (3, 5, 9)


def test_verify_tokens_below_two_are_refused():
    with pytest.raises(ExportError, match=re.escape("--verify-tokens [1, 3]: each must be >= 2")):
        ExportOptions(verify_tokens=(1, 3)).validate()

"""`--weight-quant gguf`: SmolLM2's GGUF (Q4_1 layers, a Q8_0 tied table) exported with every
quantized tensor kept in its own type. The artifact's weights stay near the file's size, and
the programs, which widen the packed bytes inside each product, give transformers' greedy ids
and logits on the same dequantized values in prefill (a GEMM over the widened weight) and
decode at one and at two rows (a product per row and band reading the packed bytes). Control:
a scale read from the neighbouring block moves the logits past the tolerance. A file whose
fused tensors and looped layers mix types (as a Q4_K_M file's do) gives transformers' ids on
its values too. Bad input (a checkpoint that is not a GGUF, a type not kept, mixes no layout
holds, a manifest naming an unknown type or layout) is refused by name."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
from checks.oracle import load_reference, logits_error, reference_greedy
from checks.built_once import built_once
from checks.weight_edits import with_weights_changed

from triton_tlaloc.artifact.loading import load_artifact
from triton_tlaloc.artifact.manifest import ArtifactError
from triton_tlaloc.engine.core import Engine
from triton_tlaloc.export import ExportOptions, export_artifact
from triton_tlaloc.export.gguf_checkpoint import GgufCheckpoint, smollm2_gguf_path
from triton_tlaloc.export.options import ExportError
from triton_tlaloc.frontends.tokenizer import ArtifactTokenizer
from triton_tlaloc.runtime.core import Runtime

STEPS = 16
QUESTION = "What is the capital of France?"
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def packed(smollm2_packed):
    return smollm2_packed


@pytest.fixture(scope="module")
def reference(smollm2_transformers):
    return load_reference(smollm2_transformers)


def mixed_type_of(name: str) -> str | None:
    """What the mixed file re-encodes: every attn_v as Q5_0 (q|k|v fuses Q4_1 and Q5_0), and
    the first two and the last layers' ffn_down as Q5_1 (the loop's layers differ)."""
    if name.endswith("attn_v.weight"):
        return "Q5_0"
    return "Q5_1" if name in {f"blk.{i}.ffn_down.weight" for i in (0, 1, 29)} else None


@pytest.fixture(scope="module")
def mixed(run_dir, smollm2_transformers):
    """SmolLM2's GGUF with some tensors in other types (checks/gguf_files.py), exported with
    --weight-quant gguf, and the values that file holds in transformers: SmolLM2's (the
    unmixed file's) with each re-encoded tensor's dequantized values in its place (q_proj and
    k_proj keep theirs: no rows to reorder). (artifact, model)."""
    import gguf as gguf_py
    import torch
    from checks.gguf_files import retyped_gguf

    gguf = built_once(run_dir / "smollm2-mixed-gguf", lambda p: (p.mkdir(), retyped_gguf(
        smollm2_gguf_path(), p / "mixed.gguf", mixed_type_of)))
    art = built_once(run_dir / "smollm2-mixed", lambda p: export_artifact(
        gguf / "mixed.gguf", p, ExportOptions(batch_ladder=(1,), context_ladder=(128,),
                                              weight_quant="gguf")))
    model = load_reference(smollm2_transformers)
    params = dict(model.named_parameters())
    proj = {"attn_v": "self_attn.v_proj", "ffn_down": "mlp.down_proj"}
    with torch.no_grad():
        for t in gguf_py.GGUFReader(str(gguf / "mixed.gguf")).tensors:
            if mixed_type_of(t.name) is None:
                continue
            _, layer, kind, _ = t.name.split(".")
            values = np.asarray(gguf_py.quants.dequantize(t.data, t.tensor_type), np.float32)
            params[f"model.layers.{layer}.{proj[kind]}.weight"].copy_(torch.from_numpy(
                values.reshape(tuple(int(d) for d in reversed(t.shape)))))
    return art, model


def chat_prompt(art) -> list[int]:
    return ArtifactTokenizer(art / "tokenizer").apply_chat_template(
        [{"role": "user", "content": QUESTION}])


def test_the_artifact_keeps_the_files_types_at_about_its_size(packed):
    manifest = json.loads((packed / "tlaloc-serving.json").read_text())
    assert manifest["model"]["weightQuant"] == "gguf"
    assert manifest["model"]["packedLayout"] == "row-bands"
    kinds = {w["slot"]: (w["dtype"], w.get("quant")) for w in manifest["weights"]}
    shapes = {w["slot"]: w["shape"] for w in manifest["weights"]}
    assert kinds["layers.gate_up"] == ("ui8", "Q4_1")  # two codes a byte, rows i and i + 1536
    assert shapes["layers.gate_up"] == [30, 1536, 576]
    assert kinds["layers.gate_up.offset"] == ("f32", "Q4_1")
    assert kinds["embed"] == ("i8", "Q8_0") and "embed_t" not in kinds  # the tied table
    assert kinds["layers.attn_norm"] == ("f32", None)
    weights = sum(w["byteLength"] for w in manifest["weights"])
    ratio = weights / smollm2_gguf_path().stat().st_size
    print(f"\nweights {weights / 2**20:.1f} MiB, {ratio:.3f}x the GGUF file")
    assert ratio <= 1.25
    # what tlaloc_device_bytes{what="weights"} shows: the packed bytes on the device
    assert sum(Runtime(packed).weight_device_bytes) == weights


def test_greedy_ids_and_logits_equal_transformers(packed, reference):
    prompt = chat_prompt(packed)
    want_ids, want_logits = reference_greedy(reference, prompt, STEPS)
    engine = Engine(Runtime(packed))
    seq = engine.new_sequence(prompt)
    first = engine.prefill([seq])[0]
    engine.free(seq)
    result = engine.generate_greedy(prompt, STEPS)
    err = logits_error(first, want_logits)
    print(f"\npacked SmolLM2: logits error {err:.2e}, "
          f"{result.median_ms_per_token:.1f} ms per token")
    assert err <= TOLERANCE
    assert result.generated_ids == want_ids

    # Two rows of a prefill call, then of a decode call (a product per row over the packed
    # bytes), each against transformers on its own ids.
    prompts = [prompt, prompt[:-3]]
    seqs = [engine.new_sequence(p) for p in prompts]
    logits = engine.prefill(seqs)
    for seq, ids, row in zip(seqs, prompts, logits):
        assert logits_error(row, reference_logits(reference, ids)) <= TOLERANCE
        seq.token_ids.append(int(np.argmax(row)))
    for seq, row in zip(seqs, engine.decode(seqs)):
        assert logits_error(row, reference_logits(reference, seq.token_ids)) <= TOLERANCE


def test_tensors_of_different_types_fused_and_looped_give_transformers_ids(mixed, reference):
    """q|k|v fusing Q4_1 and Q5_0 rows, and a loop whose ffn_down is Q5_1 in three layers and
    Q4_1 in the others: one layout each (named in the weight table), the file's values, the
    ids transformers gives on them. Control: the unmixed file's values are past tolerance."""
    art, mixed_model = mixed
    quants = {w["slot"]: w.get("quant") for w in json.loads(
        (art / "tlaloc-serving.json").read_text())["weights"]}
    assert quants["layers.qkv"] == "B5_G32_Z16_O" and quants["layers.down"] == "B5_G32_Z0_O"
    assert quants["layers.o"] == "Q4_1"
    prompt = chat_prompt(art)
    want_ids, want_logits = reference_greedy(mixed_model, prompt, STEPS)
    _, unmixed = reference_greedy(reference, prompt, 0)
    engine = Engine(Runtime(art))
    seq = engine.new_sequence(prompt)
    first = engine.prefill([seq])[0]
    engine.free(seq)
    err, err_unmixed = logits_error(first, want_logits), logits_error(first, unmixed)
    print(f"\nmixed types: logits error {err:.2e}, against the unmixed file {err_unmixed:.2e}")
    assert err <= TOLERANCE and err_unmixed > 100 * TOLERANCE
    assert engine.generate_greedy(prompt, STEPS).generated_ids == want_ids


def reference_logits(model, ids: list[int]) -> np.ndarray:
    """transformers' logits after `ids` (checks/oracle's greedy run, no steps)."""
    return reference_greedy(model, ids, 0)[1]


def test_a_neighbours_scale_fails_the_tolerance(packed, reference, tmp_path):
    """The control: the first layers' q|k|v scales read one block late."""
    art = with_weights_changed(packed, tmp_path / "wrong",
                               {"layers.qkv.scale": lambda a: np.roll(a, 1, axis=-1)})
    prompt = chat_prompt(art)
    _, want_logits = reference_greedy(reference, prompt, 0)
    engine = Engine(Runtime(art))
    err = logits_error(engine.prefill([engine.new_sequence(prompt)])[0], want_logits)
    print(f"\nneighbour's scale: logits error {err:.2e}")
    assert err > 100 * TOLERANCE


def test_tlaloc_run_answers_from_the_packed_weights(packed, reference):
    proc = subprocess.run([sys.executable, "-m", "triton_tlaloc.cli", "run", str(packed),
                           "--chat", "--prompt", QUESTION, "--max-new-tokens", str(STEPS),
                           "--ignore-eos", "--json"], capture_output=True, text=True, check=True)
    out = json.loads(proc.stdout)
    want_ids, _ = reference_greedy(reference, out["prompt_ids"], STEPS)
    print(f"\ntlaloc run: {out['text']!r} ({out['ms_per_token']} ms per token)")
    assert out["generated_ids"] == want_ids


def test_bad_input_is_refused_by_name(packed, tiny, tmp_path, monkeypatch):
    with pytest.raises(ExportError, match="--weight-quant gguf keeps the blocks of a GGUF file, "
                                          "and this checkpoint is not one"):
        export_artifact(tiny.checkpoint("llama", tied=False), tmp_path / "a", ExportOptions(
            weight_quant="gguf"))
    with pytest.raises(ExportError, match="not with --quant-head"):
        ExportOptions(weight_quant="gguf", quant_head=True).validate()

    real = GgufCheckpoint.tensor_type
    down3 = "model.layers.3.mlp.down_proj.weight"
    cases = [  # (the tensors the file is said to hold in another type, that type, the error)
        (lambda n: n == down3, "Q2_K", r"tensor blk.3.ffn_down.weight is Q2_K, a GGUF type not "
                                       r"kept packed .*--weight-quant int8 or f32"),
        (lambda n: n == down3, "F16", r"needs every layer's down packed or none.*layer 3: "
                                      r"float.*--no-layer-loop"),
        (lambda n: n.endswith("v_proj.weight"), "F16",
         r"weight l0.qkv fuses quantized and float tensors \(blk.0.attn_q.weight Q4_1, "
         r".* float"),
    ]
    for i, (which, qtype, error) in enumerate(cases):
        monkeypatch.setattr(GgufCheckpoint, "tensor_type",
                            lambda self, n, which=which, qtype=qtype:
                            qtype if which(n) else real(self, n))
        with pytest.raises(ExportError, match=error):
            export_artifact(smollm2_gguf_path(), tmp_path / str(i),
                            ExportOptions(weight_quant="gguf"))
    assert not any(tmp_path.iterdir())  # nothing half-written

    art = tmp_path / "unknown"
    shutil.copytree(packed, art)
    manifest_path = art / "tlaloc-serving.json"
    manifest = json.loads(manifest_path.read_text())
    next(w for w in manifest["weights"] if w["slot"] == "layers.o")["quant"] = "Q2_K"
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="weight slot layers.o: packed type 'Q2_K' is "
                                            "unknown to this backend"):
        load_artifact(art)
    manifest["weights"] = json.loads((packed / "tlaloc-serving.json").read_text())["weights"]
    manifest["model"]["packedLayout"] = "gguf-blocks"
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="model.packedLayout 'gguf-blocks' is unknown"):
        load_artifact(art)

"""The qwen3_5 family (three Gated DeltaNet layers, then a gated attention layer with partial
rotary) against transformers, without a server: schema tlaloc-serving-v4, its state pools and
state slots. The server tests are in test_hybrid_server.py."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
from checks.oracle import load_reference, logits_error, reference_greedy

from triton_tlaloc.batcher import Batcher, Request
from triton_tlaloc.engine.core import Engine
from triton_tlaloc.export import ExportOptions, export_artifact
from triton_tlaloc.artifact.loading import load_artifact
from triton_tlaloc.artifact.manifest import MANIFEST_NAME, SCHEMA_V4
from triton_tlaloc.pages import STATE
from triton_tlaloc.runtime.core import Runtime
from triton_tlaloc.scheduling.policy import BatchPolicy

# 150 tokens: three 64-token chunks of the delta rule, the last one partly padding.
PROMPT = [(i * 37 + 11) % 240 + 10 for i in range(150)]
STEPS = 16
TOL = 1e-4  # of the largest logit, f32
OPTS = dict(batch_ladder=(1, 2), context_ladder=(64, 256), block_size=8)


def no_decay_checkpoint(src, dst):
    """Negative control: the same weights with every linear layer's decay dropped (A_log -> -40:
    exp(A_log) ~ 4e-18, so g ~ 0 and the state never fades)."""
    from safetensors.numpy import load_file, save_file

    if not dst.exists():
        shutil.copytree(src, dst)
        tensors = load_file(dst / "model.safetensors")
        for name in tensors:
            if name.endswith("linear_attn.A_log"):
                tensors[name] = np.full_like(tensors[name], -40.0)
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def hybrid(tiny, work):
    ckpt = tiny.checkpoint("qwen3_5_text", False)
    return {
        "ckpt": ckpt,
        "whole": tiny.artifact("qwen3_5_text", False, **OPTS),
        # Calls of 48 tokens: the states cross calls as well as 64-token chunks.
        "chunks": tiny.artifact("qwen3_5_text", False, **OPTS, prefill_chunk=48),
        "no_decay": export_artifact(no_decay_checkpoint(ckpt, work / "ckpt-qwen3_5-no-decay"),
                                    work / "art-qwen3_5-no-decay", ExportOptions(**OPTS)),
        "reference": reference_greedy(load_reference(ckpt), PROMPT, STEPS),
    }


def first_logits_and_ids(art, prompt=PROMPT, steps=STEPS):
    engine = Engine(Runtime(art))
    seq = engine.new_sequence(prompt)
    first = engine.prefill_chunked(seq)[0]
    calls = engine.executions
    engine.free(seq)
    return first, engine.generate_greedy(prompt, steps).generated_ids, calls


def test_the_artifact_is_v4_with_state_pools_only_for_linear_layers(hybrid):
    art = load_artifact(hybrid["whole"])
    assert art.schema == SCHEMA_V4
    ls = art.linear_state
    assert ls.layers == (0, 1, 2) and ls.num_slots == 8  # four times the largest batch
    assert {p.name for p in art.pools} == {"l3.k", "l3.v"}  # KV pages for the attention layer
    assert {(p.layer, p.kind) for p in ls.pools} == {(i, k) for i in (0, 1, 2)
                                                     for k in ("conv", "recurrent")}
    entry = art.entries["prefill_b2_c64"]
    roles = [s.role for s in entry.program.inputs]
    assert roles.count("STATE_SLOTS") == 1 and roles.count("STATE_POOL_IN") == 6
    donated = {entry.program.inputs[i].name for _, i in entry.program.donation}
    assert {f"l{i}.{k}.in" for i in (0, 1, 2) for k in ("conv", "recurrent")} <= donated


def test_the_bodies_are_plain_stablehlo_and_a_custom_call_is_refused(hybrid, work,
                                                                       monkeypatch):
    """The triangular solve is written as a loop: jax's solve_triangular lowers to LAPACK's trsm
    (a custom call) on CPU, which a Triton backend process had never initialized and hung on.
    Negative control: put solve_triangular back and the export is refused by name."""
    art = load_artifact(hybrid["whole"])
    assert not any("custom_call" in art.body_text(e) for e in art.entries.values())

    from jax.scipy.linalg import solve_triangular

    from triton_tlaloc.export import linear_attention
    from triton_tlaloc.export import writer as export

    def lapack_inverse(strict):
        import jax.numpy as jnp
        eye = jnp.broadcast_to(jnp.eye(strict.shape[-1], dtype=strict.dtype), strict.shape)
        return solve_triangular(strict + eye, eye, lower=True, unit_diagonal=True)

    monkeypatch.setattr(linear_attention, "unit_lower_inverse", lapack_inverse)
    with pytest.raises(export.ExportError, match="custom call.*lapack_strsm.*plain StableHLO"):
        export_artifact(hybrid["ckpt"], work / "art-qwen3_5-lapack", ExportOptions(**OPTS))
    assert not (work / "art-qwen3_5-lapack").exists()


@pytest.mark.parametrize("variant", ["whole", "chunks"])
def test_greedy_ids_and_logits_match_transformers(hybrid, variant):
    want_ids, want_logits = hybrid["reference"]
    logits, ids, calls = first_logits_and_ids(hybrid[variant])
    err = logits_error(logits, want_logits)
    print(f"qwen3_5 {variant}: {calls} prefill calls, logits error {err:.2e}")
    assert calls == (1 if variant == "whole" else 4)  # 150 tokens in calls of 48
    assert ids == want_ids
    assert err <= TOL


def test_tlaloc_run_in_a_fresh_process_gives_transformers_ids(hybrid):
    """`tlaloc run`, in a process that has lowered nothing (where a LAPACK custom call hung)."""
    want_ids, _ = hybrid["reference"]
    proc = subprocess.run([sys.executable, "-m", "triton_tlaloc.cli", "run", str(hybrid["whole"]),
                           "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens",
                           str(STEPS), "--ignore-eos", "--json"], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["generated_ids"] == want_ids


TOL_BF16 = 2e-3  # bf16 weights: 150 tokens of recurrent state carry rounding-boundary flips


def test_bf16_weights_match_transformers_with_bf16_arithmetic(hybrid, tiny):
    """bf16 linears ([out, in], inputs rounded to bf16) against transformers with its Linear
    weights and inputs rounded the same way; negative control: the f32 reference, from which
    bf16 weights are further than the tolerance."""
    art = tiny.artifact("qwen3_5_text", False, "bf16", **OPTS)
    want_ids, want_logits = reference_greedy(load_reference(hybrid["ckpt"],
                                                            bf16_arithmetic=True), PROMPT, STEPS)
    logits, ids, _ = first_logits_and_ids(art)
    err = logits_error(logits, want_logits)
    f32_err = logits_error(logits, hybrid["reference"][1])
    print(f"qwen3_5 bf16: logits error {err:.2e}; against the f32 reference {f32_err:.2e}")
    assert ids == want_ids
    assert err <= TOL_BF16
    assert f32_err > TOL_BF16


def test_without_the_decay_the_check_fails(hybrid):
    _, want_logits = hybrid["reference"]
    logits, _, _ = first_logits_and_ids(hybrid["no_decay"], steps=1)
    err = logits_error(logits, want_logits)
    print(f"qwen3_5 with the decay dropped: logits error {err:.2e}")
    assert err > 100 * TOL


def recurrence_logits(art, prompt=PROMPT) -> np.ndarray:
    """The prompt fed one token at a time through the decode entries: the one-token recurrence
    of the delta rule, and the conv state carried from step to step."""
    engine = Engine(Runtime(art, entries=["decode_b1_c64", "decode_b1_c256"]))
    seq = engine.new_sequence(prompt[:1])
    logits = engine.decode([seq])
    for token in prompt[1:]:
        seq.token_ids.append(token)
        logits = engine.decode([seq])
    assert engine.executions == len(prompt)
    return logits[0]


def test_chunked_prefill_equals_the_one_token_recurrence(hybrid):
    """One prefill call (three 64-token chunks: matmuls and a triangular solve) against 150
    decode steps (the recurrence); negative control: the prefill of the model without decay."""
    step = recurrence_logits(hybrid["whole"])
    chunked, _, _ = first_logits_and_ids(hybrid["whole"], steps=1)
    no_decay, _, _ = first_logits_and_ids(hybrid["no_decay"], steps=1)
    ok, bad = logits_error(chunked, step), logits_error(no_decay, step)
    print(f"chunked prefill vs the recurrence: {ok:.2e}; without decay: {bad:.2e}")
    assert ok <= TOL
    assert bad > 100 * TOL


def test_two_sequences_batched_equal_their_solo_runs(hybrid):
    """A 2-row prefill whose shorter row is mostly padding (the padding must leave its states
    untouched), then 12 batched decode steps."""
    art = hybrid["whole"]
    prompts = [PROMPT, PROMPT[40:137]]
    solo = [first_logits_and_ids(art, p, 12)[:2] for p in prompts]
    engine = Engine(Runtime(art))
    seqs = [engine.new_sequence(p) for p in prompts]
    first = logits = engine.prefill(seqs)
    assert engine.last_entry == "prefill_b2_c256_t192"  # the 150-token row, 42 padding
    assert len({s.state_slot for s in seqs}) == 2
    ids = [[], []]
    for _ in range(12):
        for s, row, out in zip(seqs, logits, ids):
            out.append(int(np.argmax(row)))
            s.token_ids.append(out[-1])
        logits = engine.decode(seqs)
    assert engine.last_entry == "decode_b2_c256"
    for r in range(2):
        assert logits_error(first[r], solo[r][0]) <= 1e-5
        assert ids[r] == solo[r][1]


def test_a_freed_slot_reused_gives_the_ids_of_a_fresh_engine(hybrid, work):
    """One state slot: sequence A runs and ends, B gets A's slot (not cleared) and must give
    what a fresh engine gives; while A holds the slot, B is refused by name and A goes on."""
    art = export_artifact(hybrid["ckpt"], work / "art-qwen3_5-one-slot",
                          ExportOptions(**OPTS, state_slots=1))
    prompt_b = PROMPT[60:120]
    fresh = first_logits_and_ids(art, prompt_b, 8)[1]
    batcher = Batcher(Engine(Runtime(art)), BatchPolicy(cohort_wait_s=0.0, prefill_wait_s=0.0))
    replies = {"a": [], "b": []}

    def send(seq_id, tokens, start=False, end=False):
        batcher.submit(Request(seq_id, tokens, start, end, replies[seq_id].append))
        batcher.run_pending()
        return replies[seq_id][-1]

    a = send("a", PROMPT, start=True)
    assert batcher.sequences["a"].state_slot == 0
    refused = send("b", prompt_b, start=True)
    assert refused.code == "UNAVAILABLE" and "no free linear-attention state slot" in refused.error
    assert "1 sequences hold slots" in refused.error and "a (" not in refused.error
    assert batcher.stats.refusals == {"state_slots": 1}
    for _ in range(4):  # A is untouched by the refusal
        a = send("a", [int(np.argmax(a.logits))])
        assert a.error is None
    send("a", [], end=True)
    assert batcher.engine.blocks.pools()[STATE].free == 1
    # The freed slot still holds A's states: B is right only because it starts at position 0.
    assert np.abs(batcher.engine.rt.pool_snapshot("l0.recurrent")[0]).max() > 0.01
    b = send("b", prompt_b, start=True)
    assert batcher.sequences["b"].state_slot == 0  # A's slot, holding A's last state
    ids = []
    for _ in range(8):
        ids.append(int(np.argmax(b.logits)))
        b = send("b", [ids[-1]])
    assert ids == fresh


def test_state_bytes_per_sequence_are_the_same_at_64_and_4096_positions(hybrid, work):
    """The state memory per sequence, from the manifest, against the allocated pools; a
    sequence at 64 positions and one at 4,096 hold one slot each, while their KV pages grow
    with the context. The 4,096-position sequence's ids still equal transformers'."""
    art_path = export_artifact(hybrid["ckpt"], work / "art-qwen3_5-4k",
                               ExportOptions(batch_ladder=(1,), context_ladder=(64, 4096),
                                             block_size=16, prefill_chunk=512, prefill_tokens=(),
                                             state_slots=2))
    manifest = json.loads((art_path / MANIFEST_NAME).read_text())
    cfg = json.loads((hybrid["ckpt"] / "config.json").read_text())
    k, v = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    hk, hv, kernel = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"], \
        cfg["linear_conv_kernel_dim"]
    per_layer = 4 * ((kernel - 1) * (2 * hk * k + hv * v) + hv * k * v)  # conv + recurrent, f32
    ls = manifest["model"]["linearState"]
    assert ls["bytesPerSlot"] == len(ls["layers"]) * per_layer == 3 * per_layer
    rt = Runtime(art_path)
    assert rt.state_pool_bytes == ls["numSlots"] * ls["bytesPerSlot"]
    assert sum(rt.pools[p["name"]].nbytes for p in ls["pools"]) == rt.state_pool_bytes
    engine = Engine(rt)
    held = {}
    for length in (64, 4096):
        prompt = [(i * 37 + 11) % 240 + 10 for i in range(length)]
        seq = engine.new_sequence(prompt)
        engine.prefill_chunked(seq)
        assert seq.num_cached == length and seq.state_slot is not None
        held[length] = (len(seq.pages), engine.blocks.pools()[STATE].used * ls["bytesPerSlot"])
        engine.free(seq)
    print(f"pages, state bytes held: {held}")
    assert held[64][1] == held[4096][1] == ls["bytesPerSlot"]
    assert (held[64][0], held[4096][0]) == (4, 256)
    prompt = [(i * 37 + 11) % 240 + 10 for i in range(4090)]
    want, _ = reference_greedy(load_reference(hybrid["ckpt"]), prompt, 4)
    assert engine.generate_greedy(prompt, 4).generated_ids == want


def test_a_prompt_failing_after_its_first_calls_ends_the_sequence(hybrid):
    """A state cannot be rewound: when a prompt that runs in calls of 48 fails after its first
    call wrote the states, the sequence is ended (INTERNAL, saying so) and its pages and slot
    freed; a failure on the first call leaves a held sequence as it was."""
    rt = Runtime(hybrid["chunks"])
    engine = Engine(rt)
    batcher = Batcher(engine, BatchPolicy(cohort_wait_s=0.0, prefill_wait_s=0.0))
    replies = []
    run, calls = rt.run, []

    def failing_second_call(entry, step):
        calls.append(entry)
        if len(calls) == 2:
            raise RuntimeError("injected failure")
        return run(entry, step)

    rt.run = failing_second_call
    batcher.submit(Request("s", PROMPT, True, False, replies.append))
    batcher.run_pending()
    assert replies[-1].code == "INTERNAL"
    assert "injected failure" in replies[-1].error and "sequence ended" in replies[-1].error
    assert "s" not in batcher.sequences
    assert engine.blocks.pools()[STATE].used == 0 and engine.blocks.full.used == 0
    # A held sequence whose continuation fails in its first call keeps its state and goes on.
    rt.run = run
    batcher.submit(Request("t", PROMPT[:40], True, False, replies.append))
    batcher.run_pending()
    held = batcher.sequences["t"]
    before = (list(held.token_ids), held.num_cached, list(held.pages), held.state_slot)
    calls.clear()
    rt.run = lambda entry, step: (_ for _ in ()).throw(RuntimeError("injected failure"))
    batcher.submit(Request("t", PROMPT[40:100], False, False, replies.append))
    batcher.run_pending()
    assert replies[-1].code == "INTERNAL" and "sequence ended" not in replies[-1].error
    assert (list(held.token_ids), held.num_cached, list(held.pages), held.state_slot) == before
    rt.run = run
    batcher.submit(Request("t", PROMPT[40:100], False, False, replies.append))
    batcher.run_pending()
    solo = Engine(Runtime(hybrid["chunks"]))
    seq = solo.new_sequence(PROMPT[:100])
    assert logits_error(replies[-1].logits, solo.prefill_chunked(seq)[0]) <= 1e-5


def test_a_multimodal_qwen3_5_checkpoint_serves_its_text_decoder(work):
    """Qwen3.5 checkpoints are multimodal (Qwen3_5ForConditionalGeneration): the text decoder is
    read from text_config and model.language_model.*, the vision tower is left out, and its
    image and video placeholder ids are refused by name."""
    from checks.oracle import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(work / "ckpt-qwen3_5-multimodal", "qwen3_5", seed=2)
    art = export_artifact(ckpt, work / "art-qwen3_5-multimodal", ExportOptions(**OPTS))
    loaded = load_artifact(art)
    assert loaded.schema == SCHEMA_V4 and loaded.model.family == "qwen3_5_text"
    assert {(t["id"], t["configKey"]) for t in loaded.model.refused_tokens} == {
        (250, "image_token_id"), (251, "video_token_id")}
    want_ids, want_logits = reference_greedy(load_reference(ckpt), PROMPT, STEPS)
    logits, ids, _ = first_logits_and_ids(art)
    print(f"multimodal qwen3_5: logits error {logits_error(logits, want_logits):.2e}")
    assert ids == want_ids
    assert logits_error(logits, want_logits) <= TOL

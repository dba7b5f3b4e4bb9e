"""Mixtures of experts (export/moe.py): tiny random qwen3_moe (5 experts, top 2, renormalized;
a dense layer between two sparse ones), mixtral (8 experts, top 2, every layer sparse: the
layer loop) and the qwen3_5_moe hybrid (Gated DeltaNet and attention layers, 6 experts and a
shared expert with its sigmoid gate) give transformers' greedy ids and logits within 1e-5 (the
hybrid 1e-4, its family's tolerance), alone (a decode call reads each row's chosen experts),
two sequences decoding together, and a prompt in chunks of 16 (a prefill call runs every
expert, or its rows grouped by expert in blocks); `tlaloc run` gives the same ids. The grouped
blocks equal every expert's sum on their own too, an expert with no rows and all rows on one
expert included. Controls: top k off by one, the routing weights not renormalized, the shared
expert ungated, each change the ids. The routing's tie rule (the lower expert index) is its
own test. A qwen3moe GGUF is read with the same ids. Quantized experts, fp8 KV, speculation,
prefix reuse and the host tier work on a mixture; so do int4 experts and a GGUF's experts
kept in their blocks. Mixtures this exporter does not serve and AWQ / GPTQ experts are refused
by name (expert parallelism: tests/multi_device)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from checks.engine_runs import alone_and_together
from checks.oracle import incremental_logits, load_reference, logits_error, reference_greedy

from triton_tlaloc.artifact.loading import load_artifact
from triton_tlaloc.engine.core import Engine
from triton_tlaloc.export import ExportOptions, config, export_artifact, moe
from triton_tlaloc.export.config import CheckpointError
from triton_tlaloc.export.options import ExportError
from triton_tlaloc.runtime.core import Runtime

TOL = 1e-5  # of the largest logit, f32
OPTS = dict(batch_ladder=(1, 2), context_ladder=(64,), block_size=8, prefill_chunk=16)
PROMPT_A = [(i * 53 + 7) % 240 + 10 for i in range(40)]
PROMPT_B = [(i * 31 + 3) % 240 + 10 for i in range(23)]
STEPS = 8
FAMILIES = ["qwen3_moe", "mixtral"]


@pytest.fixture(scope="module")
def arts(tiny, work):
    """(family, the prompt's expert block) -> artifact. The tiny models' prompt chunks run
    every expert (fewer rows than whole blocks of 64 would hold); blocks of 4 make them run
    grouped by expert."""
    made = {}

    def get(family, block=moe.EXPERT_BLOCK):
        if (family, block) not in made:
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(moe, "EXPERT_BLOCK", block)
                made[family, block] = export_artifact(
                    tiny.checkpoint(family, False), work / f"moe-{family}-{block}",
                    ExportOptions(**OPTS))
        return made[family, block]
    return get


def reference_outcome(ckpt):
    """transformers' A ids and first logits; A's and B's ids and their last logits, each
    prompt's greedy run in one incremental pass."""
    model, runs = load_reference(ckpt), []
    for prompt in (PROMPT_A, PROMPT_B):
        step = incremental_logits(model)
        first = logits = step(prompt)
        ids = []
        for _ in range(STEPS):
            ids.append(int(np.argmax(logits)))
            logits = step([ids[-1]])
        runs.append((ids, first, logits))
    return {"first": runs[0][1], "alone": runs[0][0], "together": [r[0] for r in runs],
            "last": np.stack([r[2] for r in runs])}


# (family, experts, sparse layers, the tolerance: the hybrid's Gated DeltaNet layers take
# tests/test_hybrid.py's)
SHAPES = {"qwen3_moe": (5, [0, 2], TOL), "mixtral": (8, [0, 1], TOL),
          "qwen3_5_moe_text": (6, [0, 1, 2, 3], 1e-4)}


@pytest.mark.parametrize("family, block", [("qwen3_moe", 64), ("mixtral", 64), ("mixtral", 4),
                                           ("qwen3_5_moe_text", 64)])
def test_greedy_ids_and_logits_equal_transformers(tiny, arts, family, block):
    art = arts(family, block)
    manifest = json.loads((art / "tlaloc-serving.json").read_text())
    experts = manifest["model"]["experts"]
    count, layers, tol = SHAPES[family]
    assert (experts["numExperts"], experts["topK"], experts["layers"]) == (count, 2, layers)
    assert experts["sharedIntermediateSize"] == (32 if family == "qwen3_5_moe_text" else 0)
    assert manifest["model"]["layerLoop"] == (family == "mixtral")
    got = alone_and_together(art, PROMPT_A, PROMPT_B, STEPS)
    want = reference_outcome(tiny.checkpoint(family, False))
    assert got["alone"] == want["alone"]
    assert got["together"] == want["together"]
    for key in ("first", "last"):
        err = logits_error(got[key], want[key])
        print(f"{family} {key} logits error {err:.2e}")
        assert err <= tol, f"{key} logits off by {err:.2e} of the largest"


def test_tlaloc_run_gives_transformers_ids(tiny, arts):
    out = subprocess.run([sys.executable, "-m", "triton_tlaloc.cli", "run", str(arts("qwen3_moe")),
                          "--prompt-ids", ",".join(map(str, PROMPT_A)), "--max-new-tokens",
                          str(STEPS), "--ignore-eos", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    want, _ = reference_greedy(load_reference(tiny.checkpoint("qwen3_moe", False)), PROMPT_A,
                               STEPS)
    assert json.loads(out.stdout)["generated_ids"] == want


@pytest.mark.parametrize("family, change", [("qwen3_moe", "top_k_plus_one"),
                                            ("qwen3_moe", "not_renormalized"),
                                            ("qwen3_5_moe_text", "no_shared_gate")])
def test_control_routing_changed_changes_the_ids(tiny, arts, work, monkeypatch, family, change):
    """Each change to the mixture the exporter could get wrong changes the ids: one expert
    more a token, the routing weights not renormalized, the shared expert added without its
    sigmoid gate."""
    import jax.numpy as jnp

    from triton_tlaloc.export import layers

    experts_of = config._experts

    def changed(cfg, n):
        m = experts_of(cfg, n)
        return config.Experts(m.layers, m.num_experts, m.top_k + (change == "top_k_plus_one"),
                              m.intermediate_size, m.norm_topk_prob and change != (
                                  "not_renormalized"), m.shared_intermediate_size)
    monkeypatch.setattr(config, "_experts", changed)
    if change == "no_shared_gate":  # sigmoid(gate . x) taken as 1
        monkeypatch.setattr(layers, "shared_weight", lambda x, gate: jnp.ones_like(x[..., :1]))
    art = export_artifact(tiny.checkpoint(family, False), work / f"moe-{change}",
                          ExportOptions(**OPTS))
    monkeypatch.undo()
    got = Engine(Runtime(art)).generate_greedy(PROMPT_A, STEPS).generated_ids
    want = Engine(Runtime(arts(family))).generate_greedy(PROMPT_A, STEPS).generated_ids
    assert got != want


# the experts' dtype as the artifact stores them
CODES = {"int8": "i8", "fp8": "f8E4M3FN", "int4": "ui8"}


@pytest.mark.parametrize("family, quant", [("qwen3_moe", "int8"), ("mixtral", "fp8"),
                                           ("qwen3_moe", "int4"), ("mixtral", "int4")])
def test_quantized_experts_equal_transformers_on_the_dequantized_weights(tiny, work, family,
                                                                         quant):
    """--weight-quant int8 / fp8: each expert's codes with a scale per output channel; int4:
    each expert packed as a linear is (two codes a byte in row bands, a scale per 32 inputs),
    the layer loop's stacked over the layers too; the router stays f32. The same ids as
    transformers with every linear and expert replaced by its dequantized values, logits
    within 1e-5; alone (a decode row reads its chosen experts' bytes) and in chunks of 16
    grouped by expert (blocks of 4). Control: the unquantized model's logits are past the
    tolerance."""
    from checks.oracle import quantized_reference

    ckpt = tiny.checkpoint(family, False)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(moe, "EXPERT_BLOCK", 4)
        art = export_artifact(ckpt, work / f"moe-{family}-{quant}",
                              ExportOptions(**OPTS, weight_quant=quant))
    slots = {w.slot: w for w in load_artifact(art).weights}
    stack = "layers." if "layers.experts_down" in slots else "l0."
    assert slots[stack + "experts_down"].dtype == CODES[quant]
    assert slots[stack + "router"].dtype == "f32"
    if quant == "int4":  # [(layers,) experts, rows / 2, inputs]
        assert slots[stack + "experts_down"].shape[-2:] == (32, 64)
    model = quantized_reference(load_reference(ckpt), quant)
    want, first = reference_greedy(model, PROMPT_A, STEPS)
    engine = Engine(Runtime(art))
    assert engine.generate_greedy(PROMPT_A, STEPS).generated_ids == want
    err = logits_error(engine.prefill_chunked(engine.new_sequence(PROMPT_A))[0], first)
    print(f"{family} {quant} experts: logits error {err:.2e}")
    assert err <= TOL
    _, plain = reference_greedy(load_reference(ckpt), PROMPT_A, 0)  # the control
    assert logits_error(first, plain) > 10 * TOL


def test_fp8_kv_speculation_prefix_reuse_and_the_host_tier_on_a_mixture(tiny, work):
    """The features a dense model has, on qwen3_moe (fp8 KV pools, verify entries of 3):
    transformers' ids with keys and values rounded as the pool stores them; prompt-lookup
    drafts (and drafts known right, which must save calls) give the same ids; a prompt whose
    prefix a kept sequence holds reuses it with the same ids; a sequence moved through the host
    tier continues with exactly the same logits."""
    from checks.oracle import fp8_kv_reference
    from test_kv_transfer import check_moved_sequence

    from triton_tlaloc.generation.drafting import prompt_lookup

    ckpt = tiny.checkpoint("qwen3_moe", False)
    art = export_artifact(ckpt, work / "moe-features", ExportOptions(
        **OPTS, kv_dtype="fp8", verify_tokens=(3,)))
    model = load_reference(ckpt)
    with fp8_kv_reference(model):
        want, _ = reference_greedy(model, PROMPT_A, STEPS)
    engine = Engine(Runtime(art), prefix_reuse=True)
    assert engine.generate_greedy(PROMPT_A, STEPS).generated_ids == want
    looked_up = engine.generate_greedy(PROMPT_A, STEPS, speculate=2, drafter=prompt_lookup)
    assert looked_up.generated_ids == want
    assert looked_up.reused_tokens >= 32  # the first run's kept blocks
    fresh = Engine(Runtime(art))  # (no kept blocks: the calls are the steps')
    before = fresh.executions
    plain = fresh.generate_greedy(PROMPT_B, STEPS).generated_ids
    plain_calls = fresh.executions - before

    def known(history, k):  # drafts that are the greedy ids
        return plain[len(history) - len(PROMPT_B):][:k]
    before = fresh.executions
    assert fresh.generate_greedy(PROMPT_B, STEPS, speculate=2, drafter=known).generated_ids == (
        plain)
    assert fresh.executions - before < plain_calls
    check_moved_sequence(Runtime(art))


def routed_by_transformers(ckpt, tokens: list[int]) -> np.ndarray:
    """The (token, expert) pairs each sparse layer of transformers' model routes over
    `tokens` in one forward: [sparse layers, experts]."""
    import torch

    model, counts = load_reference(ckpt), []

    def count(module, args, out):
        counts.append(np.bincount(out[2].reshape(-1).numpy(), minlength=module.num_experts))
    for name, module in model.named_modules():
        if name.endswith("mlp.gate"):
            module.register_forward_hook(count)
    with torch.no_grad():
        model(torch.tensor([tokens]))
    return np.stack(counts)


def test_expert_load_counts_the_tokens_each_layer_routes_to_each_expert(tiny, arts, work,
                                                                        monkeypatch):
    """Runtime(expert_load=True) sums each call's EXPERT_LOAD: after a 40-token prompt in
    chunks of 16 (its last chunk 8 tokens and 8 of padding) and 8 greedy tokens, each sparse
    layer's counts are transformers' routing of those 47 tokens, expert by expert. Control:
    padding counted (the mask dropped at export) is caught."""
    from triton_tlaloc.export import layers

    ckpt = tiny.checkpoint("qwen3_moe", False)
    rt = Runtime(arts("qwen3_moe"), expert_load=True)
    ids = Engine(rt).generate_greedy(PROMPT_A, STEPS).generated_ids
    want = routed_by_transformers(ckpt, PROMPT_A + ids[:-1])
    assert rt.expert_load.tolist() == want.tolist()
    assert (rt.expert_load.sum(axis=1) == 47 * 2).all()
    assert Runtime(arts("qwen3_moe")).expert_load is None  # not counted unless asked
    make_step = layers.make_step

    def counting_padding(*a, **kw):
        step = make_step(*a, **kw)
        step.real = None
        return step
    monkeypatch.setattr(layers, "make_step", counting_padding)
    art = export_artifact(ckpt, work / "moe-padding-counted", ExportOptions(**OPTS))
    monkeypatch.undo()
    rt = Runtime(art, expert_load=True)
    Engine(rt).generate_greedy(PROMPT_A, STEPS)
    assert rt.expert_load.tolist() != want.tolist()


@pytest.mark.parametrize("qtype, weight_quant", [("Q8_0", None), ("Q4_1", "gguf")])
def test_a_moe_gguf_gives_transformers_ids_on_the_values_it_holds(tiny, work, qtype,
                                                                   weight_quant):
    """A qwen3moe GGUF as llama.cpp lays it out (the router ffn_gate_inp, each layer's experts
    stacked in ffn_gate_exps / ffn_up_exps / ffn_down_exps, quantized matrices; the dense
    layer's ffn_gate / ffn_up / ffn_down beside), written from the tiny qwen3_moe: the exporter
    finds its sparse layers and reads each expert out of its stack, dequantized (Q8_0), or
    kept in its blocks (Q4_1 with --weight-quant gguf: each expert's codes, scales and offsets
    packed, [experts, ...]), and the artifact gives transformers' ids and logits within 1e-5
    on the values the file holds."""
    import torch
    from checks.gguf_files import moe_gguf

    ckpt = tiny.checkpoint("qwen3_moe", False)
    path = work / f"tiny-qwen3moe-{qtype}.gguf"
    values = moe_gguf(ckpt, path, qtype)
    art = export_artifact(path, work / f"moe-gguf-{qtype}",
                          ExportOptions(**OPTS, weight_quant=weight_quant))
    model_json = json.loads((art / "tlaloc-serving.json").read_text())["model"]
    assert model_json["family"] == "qwen3_moe" and model_json["experts"]["layers"] == [0, 2]
    slots = {w.slot: w for w in load_artifact(art).weights}
    assert slots["l0.experts_gate_up"].dtype == ("ui8" if weight_quant else "f32")
    model = load_reference(ckpt)
    params = dict(model.named_parameters())
    inter = model.config.moe_intermediate_size
    with torch.no_grad():
        for name, v in values.items():
            if name in params:
                params[name].copy_(torch.from_numpy(v))
                continue
            layer, e, proj = name.split(".")[2], int(name.split(".")[5]), name.split(".")[6]
            stack = f"model.layers.{layer}.mlp.experts."
            rows = {"gate_proj": slice(0, inter), "up_proj": slice(inter, 2 * inter)}
            if proj == "down_proj":
                params[stack + "down_proj"][e].copy_(torch.from_numpy(v))
            else:
                params[stack + "gate_up_proj"][e, rows[proj]].copy_(torch.from_numpy(v))
    want, first = reference_greedy(model, PROMPT_A, STEPS)
    engine = Engine(Runtime(art))
    assert engine.generate_greedy(PROMPT_A, STEPS).generated_ids == want
    err = logits_error(engine.prefill_chunked(engine.new_sequence(PROMPT_A))[0], first)
    assert err <= TOL, err
    _, plain = reference_greedy(load_reference(ckpt), PROMPT_A, 0)  # the control: Q8_0 moved it
    assert logits_error(first, plain) > 10 * TOL


def test_rows_grouped_by_expert_equal_every_expert_weighted():
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    experts, hidden, inter, n, k = 6, 16, 8, 37, 2
    gate_up = jnp.asarray(rng.standard_normal((experts, 2 * inter, hidden)), jnp.float32)
    down = jnp.asarray(rng.standard_normal((experts, hidden, inter)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((n, hidden)), jnp.float32)
    weights = jnp.asarray(rng.random((n, k)), jnp.float32)
    cases = {"random": rng.integers(0, experts, (n, k)),
             "expert 3 unused": rng.choice([0, 1, 2, 4, 5], (n, k)),
             "all on expert 5": np.full((n, k), 5),
             # (experts past the stacks' count: another device's, left out)
             "another device's": rng.integers(0, experts + 3, (n, k))}
    stacks = moe.Stacks(moe.ExpertWeight({"": gate_up}), moe.ExpertWeight({"": down}))
    for what, chosen in cases.items():
        held = chosen < experts
        args = (x, weights, jnp.asarray(chosen, jnp.int32), stacks, jax.nn.silu, inter)
        got = np.asarray(jax.jit(lambda: moe._grouped(*args, moe._blocks(n * k, experts)))())
        want = np.asarray(moe._every_expert(x, weights * held, jnp.asarray(
            np.where(held, chosen, 0), jnp.int32), stacks, jax.nn.silu, inter))
        assert held.all() == (what != "another device's")
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max(),
                                   err_msg=what)


def test_ties_go_to_the_lower_expert_index():
    """Of equal routing probabilities the lower expert index is chosen (lax.top_k). torch's
    CPU topk orders ties by its selection algorithm instead (measured: of [.1, .3, .3, .3, 0]
    it takes experts 1 and 3), so a tie at the k-th place is the one case transformers and the
    artifact may route differently; random routers never tie."""
    import jax.numpy as jnp

    from triton_tlaloc.export.moe import route

    moe = config.Experts((0,), 5, 2, 4, True)
    probs = np.array([[.1, .3, .3, .3, 1e-9], [.25, .25, .25, .25, 1e-9]], np.float32)
    # the router the identity: the logits are the log-probabilities, their softmax these
    weights, chosen = route(moe, jnp.log(jnp.asarray(probs)), jnp.eye(5, dtype=jnp.float32))
    assert np.asarray(chosen).tolist() == [[1, 2], [0, 1]]
    np.testing.assert_allclose(np.asarray(weights), 0.5, rtol=1e-6)


def test_what_is_not_served_is_refused_by_name(tiny, tmp_path):
    src = tiny.checkpoint("qwen3_moe", False)
    for family, missing in (("qwen2_moe", "q/k/v biases"), ("gpt_oss", "attention sinks"),
                            ("deepseek_v3", "multi-head latent attention")):
        with pytest.raises(CheckpointError, match=f"model_type '{family}': a mixture of "
                                                  f"experts .*{missing}"):
            config.config_from_hf({**json.loads((src / "config.json").read_text()),
                                    "model_type": family}, "m")
    with pytest.raises(ExportError, match="--weight-quant awq: a mixture of experts' AWQ "
                                          "weights are not read packed yet"):
        export_artifact(src, tmp_path / "q", ExportOptions(**OPTS, weight_quant="awq"))
    assert not any(tmp_path.iterdir())

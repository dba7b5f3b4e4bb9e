"""Tensor parallelism on four CPU devices: artifacts exported for 2 and 4 devices give the
one-device artifact's greedy ids and logits (1e-5 of the largest logit, f32) for every family,
alone and batched, with prompts in chunks over several key blocks; the pools stay in place on
every device; each device holds its part of every split weight and pool. Controls: a fused
weight cut into contiguous shards fails the tolerance; a row-parallel weight split on the
wrong axis keeps the values but the partitioner has to gather it (more collectives)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from checks.engine_runs import alone_and_together
from checks.oracle import logits_error

from triton_tlaloc.export import ExportOptions, export_artifact, moe
from triton_tlaloc.export import tensor_parallel
from triton_tlaloc.export.options import ExportError
from triton_tlaloc.engine.core import Engine
from triton_tlaloc.artifact.loading import load_artifact
from triton_tlaloc.artifact.manifest import ArtifactError, numpy_dtype
from triton_tlaloc.runtime.core import Runtime
from triton_tlaloc.artifact.sharding import Segment, Split

TOL = 1e-5  # of the largest logit, f32
# Two contexts, the larger over two key blocks (prefill and decode loop over them); prompts of
# 40 go in chunks of 16. Decode calls take key blocks of 8, or of 16 past 32 positions.
OPTS = dict(batch_ladder=(1, 2), context_ladder=(32, 64), block_size=8, prefill_chunk=16,
            attention_block=32, decode_attention_block=(8, 16))
PROMPT_A = [(i * 53 + 7) % 240 + 10 for i in range(40)]
PROMPT_B = [(i * 31 + 3) % 240 + 10 for i in range(23)]
STEPS = 8


def test_the_process_has_four_devices():
    assert jax.device_count() == 4, "tests/multi_device needs XLA_FLAGS set before JAX starts"


def checkpoint(tiny, family):
    if family == "gemma3_text":
        return tiny.window_checkpoint(family)  # rings, sliding and full layers, tied head
    return tiny.checkpoint(family, tied=family == "qwen3")


@pytest.fixture(scope="module")
def arts(tiny, work):
    """(family, devices, variant) -> artifact, exported once."""
    made = {}

    def get(family, n, **extra):
        key = (family, n, tuple(sorted(extra.items())))
        if key not in made:
            out = work / f"tp-{family}-{n}-{len(made)}"
            made[key] = export_artifact(checkpoint(tiny, family), out,
                                        ExportOptions(**{**OPTS, **extra}, tensor_parallel=n))
        return made[key]
    return get


def outcome(art, **runtime):
    return alone_and_together(art, PROMPT_A, PROMPT_B, STEPS, **runtime)


def assert_same(got, want):
    assert got["alone"] == want["alone"]
    assert got["together"] == want["together"]
    for key in ("first", "last"):
        err = logits_error(got[key], want[key])
        assert err <= TOL, f"{key} logits off by {err:.2e} of the largest"


def collectives(rt, entry: str = "decode_b1") -> dict[str, int]:
    """The collectives in the compiled decode entry of batch 1, or another entry (its
    optimized HLO)."""
    name = min(n for n in rt.executables if n.startswith(entry))
    text = "".join(m.to_string() for m in rt.executables[name].hlo_modules())
    return {op: text.count(f" {op}(") for op in ("all-reduce", "all-gather",
                                                  "collective-permute", "all-to-all")}


# (qwen3 on 4 devices: the int4 test; llama on 4, each KV head on two devices: the LoRA test;
# gemma3_text's rings split alike on 2 and 4)
@pytest.mark.parametrize("family, devices", [("llama", (2,)), ("qwen3", (2,)),
                                             ("gemma3_text", (2,)), ("qwen3_5_text", (2, 4))])
def test_two_and_four_devices_give_the_one_device_ids_and_logits(arts, family, devices):
    one = outcome(arts(family, 1))
    layers = load_artifact(arts(family, 1)).model.layers
    loops = bool(load_artifact(arts(family, 1)).manifest["model"]["layerLoop"])
    for n in devices:
        got = outcome(arts(family, n))
        assert_same(got, one)
        rt = got["rt"]
        # Megatron: one all-reduce after o_proj (or out_proj) and one after down, per layer
        # (the layer loop's body is one layer); the embedding's rows summed over the devices
        # and the logits gathered (split by vocabulary); nothing else moves between devices.
        assert collectives(rt) == {"all-reduce": 2 * (1 if loops else layers) + 1,
                                   "all-gather": 1, "collective-permute": 0, "all-to-all": 0}
        d = rt.donation
        assert d.checked_runs == d.runs > 10 and d.in_place == d.runs and d.copied == 0


def test_the_vocabulary_copied_whole_gives_the_same_and_holds_more(arts):
    """--replicate-vocab: the embedding and the head whole on each device; the same ids and
    logits, two all-reduces a layer and nothing else, more bytes a device."""
    one = outcome(arts("qwen3", 1))
    split, whole = outcome(arts("qwen3", 2)), outcome(arts("qwen3", 2, replicate_vocab=True))
    assert_same(whole, one)
    assert collectives(whole["rt"]) == {"all-reduce": 2, "all-gather": 0,
                                        "collective-permute": 0, "all-to-all": 0}
    table = next(w.byte_length for w in split["rt"].artifact.weights if w.slot == "embed_t")
    assert (whole["rt"].weight_device_bytes[0] - split["rt"].weight_device_bytes[0]
            == table // 2)


def test_each_device_holds_its_part_of_every_split_weight_and_pool(arts):
    for n in (2, 4):
        rt = Runtime(arts("llama", n))
        art = rt.artifact
        tp = art.tensor_parallel
        for w in art.weights:
            shards = rt.weights[w.slot]
            assert len(shards) == n
            split = tp.weights.get(w.slot)
            want = w.shape if split is None else split.shard_shape(w.shape, n)
            assert all(s.shape == want for s in shards), w.slot
        assert {"layers.qkv", "layers.o", "layers.gate_up", "layers.down", "embed",
                "lm_head"} <= set(tp.weights)
        assert not {"final_norm", "layers.attn_norm", "layers.mlp_norm"} & set(tp.weights)
        one = Runtime(arts("llama", 1), entries=[])
        copies = tp.kv_head_copies  # 2 KV heads: 1 a device at 2, held twice at 4
        assert copies == n // 2
        for j in range(n):
            assert rt.pool_device_bytes[j] * n == one.kv_pool_bytes * copies
        split_bytes = sum(w.byte_length for w in art.weights if w.slot in tp.weights)
        rest = sum(w.byte_length for w in art.weights if w.slot not in tp.weights)
        kv_copied = sum(w.byte_length for w in art.weights if w.slot == "layers.qkv") // 2
        for j in range(n):  # k and v are half of qkv here (4 heads, 2 KV heads)
            assert rt.weight_device_bytes[j] == (rest + (split_bytes + (copies - 1) * kv_copied)
                                                 // n)


def test_pools_stay_in_place_on_every_device_and_the_control_copies(arts):
    """Over the first 100 runs every shard of every pool keeps its address; with the aliasing
    stripped (donate_kv_pools false) every run moves them."""
    for donate in (True, False):
        rt = Runtime(arts("llama", 4), donate=donate)
        engine = Engine(rt)
        for k in range(3):  # 3 x (1 prompt call + 40 decode calls)
            engine.generate_greedy(PROMPT_A[k:k + 8], 41)
        d = rt.donation
        assert d.checked_runs >= 100
        if donate:
            assert (d.in_place, d.copied) == (d.checked_runs, 0)
        else:
            assert (d.in_place, d.copied) == (0, d.checked_runs)


def test_verify_entries_run_on_four_devices(arts):
    """A speculative step's argmaxes and logits after every position, as on one device."""
    runs = []
    for n in (1, 4):
        rt = Runtime(arts("llama", n, verify_tokens=(3,)))
        engine = Engine(rt)
        runs.append(engine.generate_greedy(PROMPT_A, STEPS, speculate=2,
                                           drafter=lambda history, k: history[-k:]))
    assert runs[0].generated_ids == runs[1].generated_ids


def test_control_a_fused_weight_cut_into_contiguous_shards_fails(tiny, work, arts, monkeypatch):
    """Cutting q|k|v into contiguous halves (as an unfused weight is) gives each device parts
    of the wrong heads: the tolerance catches it."""
    plan = tensor_parallel.plan

    def contiguous_qkv(*a, **kw):
        tp = plan(*a, **kw)
        for name, split in tp.weights.items():
            if name.endswith("qkv"):
                tp.weights[name] = Split(split.axis, (Segment(sum(s.width * s.copies
                                                                  for s in split.segments)),))
        return tp
    monkeypatch.setattr(tensor_parallel, "plan", contiguous_qkv)
    art = export_artifact(checkpoint(tiny, "llama"), work / "tp-llama-contiguous",
                          ExportOptions(**OPTS, tensor_parallel=2))
    monkeypatch.undo()
    got, want = outcome(art), outcome(arts("llama", 1))
    assert logits_error(got["first"], want["first"]) > 100 * TOL


def test_control_a_row_parallel_weight_split_on_the_wrong_axis_moves_data(tiny, work, arts,
                                                                       monkeypatch):
    """o_proj and down split along their outputs instead of their inputs: XLA keeps the values
    (the program is the same) but must gather activations between the devices."""
    plan = tensor_parallel.plan

    def wrong_axis(cfg, devices, slots, *pools, **kw):
        tp = plan(cfg, devices, slots, *pools, **kw)
        shapes = {s.name: s.shape for s in slots}
        for name in ("layers.o", "layers.down"):  # [layers, out, in]: split the outputs
            tp.weights[name] = Split(1, (Segment(shapes[name][1]),))
        return tp
    monkeypatch.setattr(tensor_parallel, "plan", wrong_axis)
    art = export_artifact(checkpoint(tiny, "llama"), work / "tp-llama-wrong-axis",
                          ExportOptions(**OPTS, tensor_parallel=2))
    monkeypatch.undo()
    got = outcome(art)
    assert_same(got, outcome(arts("llama", 1)))
    moved = collectives(got["rt"])
    assert moved["all-gather"] + moved["all-to-all"] + moved["collective-permute"] > 1, moved


def test_heads_that_do_not_divide_are_refused_by_name(tiny, work):
    with pytest.raises(ExportError, match=r"--tensor-parallel 3: .*4 attention heads do not "
                                          r"divide over 3 devices"):
        export_artifact(checkpoint(tiny, "llama"), work / "tp-3",
                        ExportOptions(**OPTS, tensor_parallel=3))
    assert not (work / "tp-3").exists()


def test_a_runtime_refuses_devices_that_are_not_the_artifacts(arts, work):
    art = arts("llama", 2)
    with pytest.raises(ValueError, match=r"lowered for 2 device\(s\).*1 given"):
        Runtime(art, devices=(0,))
    with pytest.raises(ValueError, match=r"cpu has 4 device\(s\)"):
        Runtime(art, devices=(0, 7))
    broken = work / "tp-llama-says-4"
    shutil.copytree(art, broken)
    manifest = json.loads((broken / "tlaloc-serving.json").read_text())
    manifest["model"]["tensorParallel"]["devices"] = 4  # 2 KV heads in pools of 2
    for split in manifest["model"]["tensorParallel"]["pools"].values():
        split["segments"] = [[4, 1]]
    (broken / "tlaloc-serving.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="pool layers.k"):
        load_artifact(broken)


def test_devices_other_than_the_first(arts):
    """Devices 2 and 3 serve a 2-device artifact as 0 and 1 do."""
    got = outcome(arts("llama", 2), devices=(2, 3))
    assert [b.device.id for b in got["rt"].pools["layers.k"]] == [2, 3]
    assert_same(got, outcome(arts("llama", 1)))


def test_tlaloc_run_on_two_devices(arts):
    """`tlaloc run` gives its process the devices a tensor-parallel artifact needs."""
    ids = {}
    for n in (1, 2):
        out = subprocess.run([sys.executable, "-m", "triton_tlaloc.cli", "run", str(arts("llama", n)),
                              "--prompt-ids", ",".join(map(str, PROMPT_A)), "--max-new-tokens",
                              str(STEPS), "--ignore-eos", "--json"],
                             capture_output=True, text=True, timeout=300,
                             env={k: v for k, v in __import__("os").environ.items()
                                  if k != "XLA_FLAGS"})
        assert out.returncode == 0, out.stderr[-2000:]
        result = json.loads(out.stdout)
        ids[n] = result["generated_ids"]
        assert result["pools_copied"] == 0
    assert ids[1] == ids[2]


def test_a_weight_shard_is_cut_from_the_file(arts):
    """Device j's q|k|v rows are its heads' q, k and v rows of the file."""
    art = load_artifact(arts("llama", 4))
    w = next(w for w in art.weights if w.slot == "layers.qkv")
    full = np.fromfile(art.path / w.file, numpy_dtype(w.dtype)).reshape(w.shape)
    split = art.tensor_parallel.weights["layers.qkv"]
    d = art.model.head_size
    for j in range(4):
        shard = split.shard(full, j, 4)  # [layers, out, in]: 1 q head, KV head j // 2
        kv = 4 * d + (j // 2) * d
        want = np.concatenate([full[:, j * d:(j + 1) * d], full[:, kv:kv + d],
                               full[:, kv + 2 * d:kv + 3 * d]], axis=1)
        np.testing.assert_array_equal(shard, want)


def test_smollm2_on_three_devices(work, monkeypatch):
    """SmolLM2-135M (9 heads, 3 KV heads) splits over 3 devices, each holding one KV head and a
    third of every split weight; over 2 or 4 its heads do not divide, refused by name before
    any weight is converted (a weight written here fails the test)."""
    from triton_tlaloc.export import writer
    from triton_tlaloc.export.gguf_checkpoint import smollm2_gguf_path

    gguf = smollm2_gguf_path()
    opts = dict(batch_ladder=(1,), context_ladder=(64,), prefill_chunk=32)
    with monkeypatch.context() as m:
        m.setattr(writer, "_write_weights", lambda *a, **k: pytest.fail("weights written"))
        for n in (2, 4):
            with pytest.raises(ExportError, match=f"9 attention heads do not divide over {n}"):
                export_artifact(gguf, work / f"smollm2-tp{n}", ExportOptions(**opts,
                                                                            tensor_parallel=n))
    runs = {}
    for n in (1, 3):
        art = export_artifact(gguf, work / f"smollm2-tp{n}", ExportOptions(**opts,
                                                                          tensor_parallel=n))
        rt = Runtime(art)
        engine = Engine(rt)
        seq = engine.new_sequence(PROMPT_A)
        first = engine.prefill_chunked(seq)[0]
        engine.free(seq)
        runs[n] = (rt, first, engine.generate_greedy(PROMPT_A, STEPS).generated_ids)
    (one, first1, ids1), (three, first3, ids3) = runs[1], runs[3]
    assert ids3 == ids1
    assert logits_error(first3, first1) <= TOL
    assert three.pool_device_bytes == [one.kv_pool_bytes // 3] * 3
    split = sum(w.byte_length for w in three.artifact.weights
                if w.slot in three.artifact.tensor_parallel.weights)
    rest = one.weight_bytes - split
    assert three.weight_device_bytes == [rest + split // 3] * 3
    assert three.donation.copied == 0 and three.donation.in_place == three.donation.runs


@pytest.mark.parametrize("family, n", [("llama", 4), ("gemma3_text", 2), ("qwen3_5_text", 2)])
def test_a_sequence_moved_through_the_host_tier_continues_on_the_devices(arts, family, n):
    """The host tier's page moves on split pools: each device's shard of a page (its heads'
    KV, ring, state channels) read to the host and written into other pages, in place on every
    device; the sequence continues with the same ids and exactly the same logits. Control:
    pages written back in the wrong order change the logits."""
    from test_kv_transfer import check_moved_sequence

    check_moved_sequence(Runtime(arts(family, n)), order_matters=family != "qwen3_5_text")


INT4 = dict(weight_quant="int4", quant_head=True, kv_dtype="fp8")


def test_int4_weights_split_over_devices_give_the_one_device_ids_and_logits(arts):
    """--weight-quant int4 (the tied head too) with fp8 KV on 4 devices (each KV head held
    twice, the table split by vocabulary): the one-device artifact's ids and logits, the same collectives as f32 weights
    (each device widens only its own bands: nothing gathered), each device holding its part of
    the packed bytes; a sequence moved through the host tier continues the same."""
    from test_kv_transfer import check_moved_sequence

    one = outcome(arts("qwen3", 1, **INT4))
    for n in (4,):  # (2 devices: each holds whole KV heads, a simpler split than this one)
        got = outcome(arts("qwen3", n, **INT4))
        assert_same(got, one)
        rt = got["rt"]
        loops = rt.artifact.manifest["model"]["layerLoop"]
        layers = 1 if loops else rt.artifact.model.layers
        assert collectives(rt) == {"all-reduce": 2 * layers + 1, "all-gather": 1, "collective-permute": 0,
                                   "all-to-all": 0}
        tp = rt.artifact.tensor_parallel
        assert {"layers.qkv", "layers.qkv.scale", "layers.down", "layers.down.scale", "embed",
                "embed.scale"} <= set(tp.weights)
        for w in rt.artifact.weights:
            split = tp.weights.get(w.slot)
            want = w.shape if split is None else split.shard_shape(w.shape, n)
            assert all(s.shape == want for s in rt.weights[w.slot]), w.slot
    check_moved_sequence(Runtime(arts("qwen3", 4, **INT4)), order_matters=True)


def test_control_int4_bands_cut_across_devices_fail(tiny, work, arts, monkeypatch):
    """The packed q|k|v banded over all its rows at once (the one-device layout) but split as
    a tensor-parallel one: each device widens rows of other heads, and the tolerance catches
    it."""
    from triton_tlaloc.export.gguf_packed import PackedWeight

    banded_at_once = PackedWeight.arrays
    monkeypatch.setattr(PackedWeight, "arrays", lambda self, pieces=None: banded_at_once(self))
    art = export_artifact(checkpoint(tiny, "qwen3"), work / "tp-int4-one-band",
                          ExportOptions(**OPTS, **INT4, tensor_parallel=2))
    monkeypatch.undo()
    got, want = outcome(art), outcome(arts("qwen3", 1, **INT4))
    assert logits_error(got["first"], want["first"]) > 100 * TOL


def test_packed_weights_that_do_not_split_on_group_boundaries_are_refused(tiny, work):
    """The hybrid's out_proj reads 32 inputs, one group of 32: it cannot split over 2
    devices, refused by name before any weight is written."""
    with pytest.raises(ExportError, match=r"--tensor-parallel 2: .*lin_out's 32 inputs, in "
                                          r"groups of 32 \(INT4_G32\), do not split over 2 "
                                          r"devices on group boundaries"):
        export_artifact(checkpoint(tiny, "qwen3_5_text"), work / "tp-int4-hybrid",
                        ExportOptions(**OPTS, weight_quant="int4", tensor_parallel=2))
    assert not (work / "tp-int4-hybrid").exists()


def test_experts_split_over_devices_give_the_one_device_ids_and_logits(arts, tiny, work):
    """Expert parallelism: mixtral's 8 experts over 2 devices (4 each; the layer loop), each
    device computing with its own experts: the one-device ids and logits (a decode
    row's chosen experts, a prompt's every expert), the float model's collectives (the
    experts' outputs meet in one all-reduce, as a dense MLP's do), each device holding its
    experts' bytes; int4 experts, a prompt grouped by expert on each device, likewise on 2; the
    qwen3_5_moe hybrid (its shared expert split as a dense MLP) likewise on 2. qwen3_moe's 5
    experts over 2 devices are refused by name."""
    one = outcome(arts("mixtral", 1))
    n = 2  # (4 devices, 2 experts each, passed too while building)
    got = outcome(arts("mixtral", n))
    assert_same(got, one)
    rt = got["rt"]
    assert collectives(rt) == {"all-reduce": 3, "all-gather": 1, "collective-permute": 0,
                               "all-to-all": 0}
    split = rt.artifact.tensor_parallel.weights["layers.experts_gate_up"]
    shape = next(w.shape for w in rt.artifact.weights if w.slot == "layers.experts_gate_up")
    assert [s.shape for s in rt.weights["layers.experts_gate_up"]] == [
        split.shard_shape(shape, n)] * n and split.shard_shape(shape, n)[1] == 8 // n
    # int4 experts (each expert's packed arrays split with it), a prompt's pairs grouped by
    # expert on each device (blocks of 4 rows): the one-device int4 outcome (every expert over
    # a prompt), and the decode and prefill entries' collectives those of f32 every-expert's
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(moe, "EXPERT_BLOCK", 4)
        packed = outcome(arts("mixtral", 2, weight_quant="int4", prefill_chunk=32))
    assert_same(packed, outcome(arts("mixtral", 1, weight_quant="int4")))
    for entry in ("decode_b1", "prefill"):
        assert collectives(packed["rt"], entry) == collectives(got["rt"], entry)
    tp = packed["rt"].artifact.tensor_parallel
    assert {"layers.experts_down", "layers.experts_down.scale"} <= set(tp.weights)
    # the hybrid's shared expert splits as a dense MLP does, its routed experts by expert
    hybrid = outcome(arts("qwen3_5_moe_text", 2))
    assert_same(hybrid, outcome(arts("qwen3_5_moe_text", 1)))
    # a layer's three partial sums: its mixer's, its routed experts', its shared expert's
    layers = hybrid["rt"].artifact.model.layers
    assert collectives(hybrid["rt"]) == {"all-reduce": 3 * layers + 1, "all-gather": 1,
                                         "collective-permute": 0, "all-to-all": 0}
    with pytest.raises(ExportError, match=r"--tensor-parallel 2: .*5 experts do not divide "
                                          r"over 2 devices"):
        export_artifact(tiny.checkpoint("qwen3_moe", False), work / "tp-moe-5",
                        ExportOptions(**OPTS, tensor_parallel=2))


LORA = dict(batch_ladder=(1, 4), context_ladder=(64,), block_size=8, prefill_chunk=16,
            max_lora_rank=8, lora_slots=2)


def test_lora_adapters_split_over_devices_give_transformers_peft_ids(tiny, work, monkeypatch):
    """Two adapters (as tests/test_lora.py's) on 2 devices, and on 4 where each KV head is held
    by two: rows of adapter a, adapter b and none in the same calls give transformers + PEFT's
    ids and logits. Each device holds its part of a column-parallel part's B and of a
    row-parallel part's A. Control: B cut into contiguous halves (not each module's rows for
    each device) gives other ids."""
    from checks.engine_runs import adapters_together
    from checks.oracle import load_lora_reference, load_reference, reference_greedy

    from triton_tlaloc.lora.layout import LoraLayout
    from triton_tlaloc.lora.peft_adapter import read_peft_adapter

    base = tiny.checkpoint("llama", False)
    adapters = [tiny.lora_adapter("llama", "a", 4, seed=1),
                tiny.lora_adapter("llama", "b", 6, seed=2, rslora=True, layers=[1],
                                  rank_pattern={"q_proj": 8})]
    prompts = [PROMPT_A, PROMPT_B, PROMPT_A[5:]]
    want = [reference_greedy(load_lora_reference(base, a), p, STEPS)
            for a, p in zip(adapters, prompts)]
    want.append(reference_greedy(load_reference(base), prompts[2], STEPS))

    def run(n):
        art = export_artifact(base, work / f"tp-lora-{n}",
                              ExportOptions(**LORA, tensor_parallel=n))
        rt = Runtime(art)
        for slot, path in enumerate(adapters, 1):
            rt.adapters.write(slot, read_peft_adapter(path, rt.artifact.lora).arrays)
        return rt, adapters_together(Engine(rt), prompts, (1, 2, 0), STEPS)

    runtimes = {}
    for n in (2, 4):
        rt, (ids, firsts) = run(n)
        runtimes[n] = rt
        assert rt.artifact.lora.kv_copies == n // 2  # 2 KV heads: on 4 devices each on two
        assert ids == [w for w, _ in want], f"{n} devices"
        for got, (_, first) in zip(firsts, want):
            assert logits_error(got, first) <= TOL
        pools = rt.adapters.values  # q 64 | k 32 | v 32, k and v twice on 4 devices
        assert [b.shape for b in pools["lora.qkv.b"]] == [(2, 3, {2: 64, 4: 48}[n], 8)] * n
        assert [a.shape for a in pools["lora.o.a"]] == [(2, 3, 8, 64 // n)] * n
        assert [a.shape for a in pools["lora.qkv.a"]] == [(2, 3, 24, 64)] * n  # copied

    by_module = LoraLayout.slot_shards

    def contiguous(self, name, array):
        if name == "lora.qkv.b":
            return np.split(array, self.devices, axis=1)
        return by_module(self, name, array)

    monkeypatch.setattr(LoraLayout, "slot_shards", contiguous)
    rt = runtimes[2]
    rt.adapters.write(1, read_peft_adapter(adapters[0], rt.artifact.lora).arrays)
    ids, _ = adapters_together(Engine(rt), prompts[:1], (1,), STEPS)
    assert ids[0] != want[0][0]

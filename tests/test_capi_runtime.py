"""The C API runtime (runtime/capi.py): the artifact's programs run through OpenXLA's CPU plugin
(the xla-cpu-pjrt wheel) reached by pypjrt, with no JAX. `tlaloc run --runtime capi` in a
process where importing jax, jaxlib, torch or transformers raises, and with `--stdlib`
(runtime/stdlib_runner.py) numpy too, gives transformers' greedy ids for a tiny llama,
gemma3_text's rings and qwen3_5_text's state slots, and an artifact for 2 devices on two
devices the plugin makes; in this process the logits of the engine over the C API and of the
standard-library runner equal the JAX runtime's within 1e-5 of the largest for the tiny llama
and SmolLM2 (control: another prompt's last token fails the tolerance), the pools stay in
place over 100 calls (control: the aliasing stripped copies them); and a missing plugin, one
too old and a body it cannot compile are refused naming the plugin."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from checks.oracle import load_reference, logits_error, reference_greedy

from triton_tlaloc.engine.core import Engine
from triton_tlaloc.runtime import capi
from triton_tlaloc.runtime.core import Runtime
from triton_tlaloc.runtime.stdlib_runner import StdlibRunner

ROOT = Path(__file__).resolve().parent.parent
TOL = 1e-5  # of the largest logit, f32
PROMPT = [1, 17, 99, 3, 200, 41, 7, 88, 5, 60]
STEPS = 8
BARRED = "jax,jaxlib,torch,transformers"
STDLIB_BARRED = BARRED + ",numpy,ml_dtypes"
# family -> (tied, export options beside the tests' tiny ladders): one context of 32 (a
# prompt of 10 and 8 steps), so `tlaloc run` compiles few entries
ONE_CONTEXT = dict(context_ladder=(32,))
FAMILIES = {"llama": (False, ONE_CONTEXT), "gemma3_text": (True, dict(ONE_CONTEXT, block_size=4)),
            "qwen3_5_text": (False, ONE_CONTEXT)}


def guarded_run(art, barred: str, *flags: str) -> dict:
    """`tlaloc run ART --runtime capi FLAGS` in a process where importing `barred` raises."""
    run = subprocess.run(
        [sys.executable, "-m", "checks.import_guard", barred, "run", str(art), "--prompt-ids",
         ",".join(map(str, PROMPT)), "--max-new-tokens", str(STEPS), "--ignore-eos", "--json",
         "--runtime", "capi", *flags], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)


@pytest.mark.parametrize("family", FAMILIES)
def test_tlaloc_run_capi_imports_no_jax_and_gives_transformers_ids(tiny, family):
    tied, opts = FAMILIES[family]
    art = tiny.artifact(family, tied, **opts)
    want, _ = reference_greedy(load_reference(tiny.checkpoint(family, tied)), PROMPT, STEPS)
    for got in (guarded_run(art, BARRED), guarded_run(art, STDLIB_BARRED, "--stdlib")):
        assert got["generated_ids"] == want
        assert got["pools_in_place"] == got["calls"] >= STEPS and got["pools_copied"] == 0
    if family == "llama":  # control: the engine's path imports numpy, and the guard says so
        with pytest.raises(AssertionError, match="numpy: barred from this process"):
            guarded_run(art, STDLIB_BARRED)


def capi_and_jax(art, prompt, steps=STEPS):
    """Each runtime's greedy ids and logits after the prompt: the standard-library runner's,
    the engine's over the C API, over JAX."""
    runner = StdlibRunner(art)
    result = runner.generate_greedy(prompt, steps)
    out = [(result.generated_ids, np.frombuffer(result.first_logits, np.float32), runner)]
    for plugin in ("", None):
        rt = Runtime(art, plugin=plugin, first_use=True)
        engine = Engine(rt)
        ids = engine.generate_greedy(prompt, steps).generated_ids
        seq = engine.new_sequence(prompt)
        out.append((ids, engine.prefill_chunked(seq)[0], rt))
        engine.free(seq)
    return out


def test_logits_equal_the_jax_runtimes_and_the_pools_stay_in_place(tiny, smollm2):
    (ids0, first0, runner), (ids, first, rt), (want_ids, want_first, _) = capi_and_jax(
        tiny.artifact("llama", False), PROMPT)
    assert isinstance(rt.device, capi.CapiDevice)
    assert ids == want_ids and logits_error(first, want_first) <= TOL
    assert ids0 == want_ids and logits_error(first0, want_first) <= TOL
    assert runner.copied == 0 and runner.in_place == runner.calls == STEPS  # prefill + 7
    other = Engine(rt)
    seq = other.new_sequence(PROMPT[:-1] + [61])
    assert logits_error(other.prefill_chunked(seq)[0], want_first) > TOL  # the control
    other.free(seq)
    # 100 decode calls: each pool's address kept (the JAX runtime's check, runtime.donation)
    rt.check_every_run = True
    runs = rt.donation.runs
    other.generate_greedy(PROMPT, 100, ())
    d = rt.donation
    assert d.runs - runs >= 100 and d.copied == 0 and d.in_place == d.runs
    copying = Runtime(tiny.artifact("llama", False), plugin="", first_use=True, donate=False)
    Engine(copying).generate_greedy(PROMPT, 4)
    assert copying.donation.copied == copying.donation.runs > 0
    runner = StdlibRunner(tiny.artifact("llama", False), donate=False)
    runner.generate_greedy(PROMPT, 4)
    assert runner.copied == runner.calls > 0
    # SmolLM2 (its f32 export): the same ids, the logits within the tolerance
    prompt = [(i * 977 + 13) % 49000 + 100 for i in range(24)]
    (ids0, first0, _), (ids, first, _), (want_ids, want_first, _) = capi_and_jax(
        smollm2[1], prompt, 6)
    assert ids == want_ids and logits_error(first, want_first) <= TOL
    assert ids0 == want_ids and logits_error(first0, want_first) <= TOL


def test_plugins_that_cannot_serve_are_refused_by_name(tiny, tmp_path, monkeypatch):
    art = tiny.artifact("llama", False)
    with pytest.raises(capi.PluginError, match=r"PJRT plugin .*nowhere\.so.*no such file"):
        Runtime(art, plugin=str(tmp_path / "nowhere.so"))
    not_a_plugin = tmp_path / "empty.so"
    not_a_plugin.write_bytes(b"\0" * 64)
    with pytest.raises(capi.PluginError, match=r"PJRT plugin .*empty\.so: not loaded"):
        Runtime(art, plugin=str(not_a_plugin))
    monkeypatch.setattr(capi, "OLDEST_API", (99, 0))
    with pytest.raises(capi.PluginError, match=r"its C API is 0\.\d+, older than the 99\.0"):
        Runtime(art, plugin="")
    monkeypatch.undo()
    device = capi.CapiDevice()
    with pytest.raises(capi.PluginError, match=r"PJRT plugin .*xla_cpu_pjrt\.so \(cpu, API "
                                               r"0\.\d+\) cannot compile the program"):
        device.compile("module @m { func.func public @main() { no.such_op } }")
    values = device.host(device.put(np.arange(6, dtype=np.int32).reshape(2, 3)))
    assert values.tolist() == [[0, 1, 2], [3, 4, 5]]


def test_a_tensor_parallel_artifact_runs_on_two_devices_of_the_plugin(tiny, work):
    """The tiny llama exported for 2 devices runs on two devices of the CPU plugin (its own
    client makes them: no XLA_FLAGS), each holding half of each split weight and of each
    pool: transformers' ids and logits (within 1e-5 of the largest)."""
    from triton_tlaloc.export import ExportOptions, export_artifact

    ckpt = tiny.checkpoint("llama", False)
    want, want_first = reference_greedy(load_reference(ckpt), PROMPT, STEPS)
    art = export_artifact(ckpt, work / "capi-tp2", ExportOptions(
        batch_ladder=(1,), context_ladder=(32,), block_size=8, tensor_parallel=2))
    rt = Runtime(art, plugin="", first_use=True)
    assert isinstance(rt.device, capi.CapiMesh) and rt.device.size == 2
    engine = Engine(rt)
    assert engine.generate_greedy(PROMPT, STEPS).generated_ids == want
    seq = engine.new_sequence(PROMPT)
    assert logits_error(engine.prefill_chunked(seq)[0], want_first) <= TOL
    engine.free(seq)
    pool = next(iter(rt.pools.values()))
    whole = rt.artifact.pools[0].shape
    assert [b.dimensions for b in pool] == [(*whole[:-2], whole[-2] // 2, whole[-1])] * 2
    assert rt.donation.copied == 0 and rt.donation.in_place == rt.donation.runs
    # the standard-library runner, numpy barred: each device given its parts of the bytes
    got = guarded_run(art, STDLIB_BARRED, "--stdlib")
    assert got["generated_ids"] == want and got["pools_copied"] == 0


def test_lora_adapters_give_transformers_peft_ids(tiny):
    """The adapter slot write is StableHLO text (no JAX): tests/test_lora.py's two adapters
    and no adapter, in the same calls, give transformers + PEFT's ids."""
    from checks.engine_runs import adapters_together
    from test_lora import PROMPTS, STEPS as LORA_STEPS, lora_setup, reference

    from triton_tlaloc.lora.peft_adapter import read_peft_adapter

    base, art, adapters = lora_setup(tiny)
    rt = Runtime(art, plugin="", first_use=True)
    for slot, name in ((1, "a"), (2, "b")):
        rt.adapters.write(slot, read_peft_adapter(adapters[name], rt.artifact.lora).arrays)
    want = [reference(base, adapters["a"], PROMPTS[0])[0],
            reference(base, adapters["b"], PROMPTS[1])[0], reference(base, None, PROMPTS[2])[0]]
    ids, _ = adapters_together(Engine(rt), PROMPTS, (1, 2, 0), LORA_STEPS)
    assert ids == want

"""LoRA adapters on one base model (export/lora_graph.py, lora/, runtime/adapter_pools.py):
two PEFT adapters made here (random A and B, ranks 4 and 8, every attention and MLP linear;
one with rsLoRA and a rank pattern, one on some layers) loaded into an artifact's adapter
slots give transformers + PEFT's greedy ids and logits within 1e-5, alone (prompt lookup's
drafts verified too) and with rows of adapter A, adapter B and no adapter in the same calls.
Control: two rows' slots swapped change both rows' ids. Adapters that do not fit are refused
by name."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from checks.engine_runs import adapters_together
from checks.oracle import load_lora_reference, load_reference, logits_error, reference_greedy

from triton_tlaloc.engine.core import Engine
from triton_tlaloc.generation.drafting import prompt_lookup
from triton_tlaloc.export import ExportOptions, export_artifact
from triton_tlaloc.export.options import ExportError
from triton_tlaloc.lora.peft_adapter import AdapterError, read_peft_adapter
from triton_tlaloc.runtime.core import Runtime

TOL = 1e-5  # of the largest logit, f32
OPTS = dict(batch_ladder=(1, 4), context_ladder=(64,), block_size=8, prefill_chunk=16,
            max_lora_rank=8, lora_slots=2, verify_tokens=(3,))
PROMPTS = [[(i * 53 + 7) % 240 + 10 for i in range(30)],
           [(i * 31 + 3) % 240 + 10 for i in range(23)],
           [(i * 17 + 5) % 240 + 10 for i in range(19)]]
STEPS = 8


def lora_setup(tiny):
    """The tiny llama, its artifact with adapter pools, and two adapters (made once a run)."""
    return (tiny.checkpoint("llama", False), tiny.artifact("llama", False, **OPTS), {
        "a": tiny.lora_adapter("llama", "a", 4, seed=1),
        # rsLoRA, q_proj at rank 8 (rank_pattern), the rest 6, on layer 1 only
        "b": tiny.lora_adapter("llama", "b", 6, seed=2, rslora=True, layers=[1],
                               rank_pattern={"q_proj": 8})})


@pytest.fixture(scope="module")
def setup(tiny):
    return lora_setup(tiny)


def reference(base, adapter, prompt):
    model = load_lora_reference(base, adapter) if adapter else load_reference(base)
    return reference_greedy(model, prompt, STEPS)


def test_adapters_give_transformers_peft_ids_alone_and_together(setup):
    base, art, adapters = setup
    manifest = json.loads((art / "tlaloc-serving.json").read_text())["model"]["lora"]
    assert (manifest["maxRank"], manifest["slots"]) == (8, 3)
    rt = Runtime(art)
    read = {name: read_peft_adapter(path, rt.artifact.lora) for name, path in adapters.items()}
    for slot, name in ((1, "a"), (2, "b")):
        rt.adapters.write(slot, read[name].arrays)
    want = [reference(base, adapters["a"], PROMPTS[0]), reference(base, adapters["b"], PROMPTS[1]),
            reference(base, None, PROMPTS[2])]
    engine = Engine(rt)
    for (ids, first), prompt, slot in zip(want, PROMPTS, (1, 2, 0)):  # alone
        adapter = (slot, read["ab"[slot - 1]].content_hash if slot else "")
        assert engine.generate_greedy(prompt, STEPS, adapter=adapter).generated_ids == ids
        got, firsts = adapters_together(engine, [prompt], [slot], STEPS)
        assert got[0] == ids
        assert logits_error(firsts[0], first) <= TOL
    # prompt lookup's drafts (a prompt that repeats itself) verified with adapter b: its ids
    repeating = PROMPTS[1][:8] * 3
    spec = engine.generate_greedy(repeating, STEPS, adapter=(2, read["b"].content_hash),
                                  speculate=2, drafter=prompt_lookup)
    assert spec.generated_ids == reference(base, adapters["b"], repeating)[0]
    assert any(e.startswith("verify") for e in rt.donation.entries_checked)
    calls = engine.executions
    got, firsts = adapters_together(engine, PROMPTS, (1, 2, 0), STEPS)
    assert got == [ids for ids, _ in want]
    for f, (_, first) in zip(firsts, want):
        assert logits_error(f, first) <= TOL
    assert engine.executions - calls == 2 * 3 + STEPS  # each prompt 2 chunks, then together
    # the control: rows' slots swapped change both rows' ids
    swapped, _ = adapters_together(engine, PROMPTS[:2], (2, 1), STEPS)
    assert swapped[0] != want[0][0] and swapped[1] != want[1][0]


def test_tlaloc_run_with_an_adapter(setup):
    base, art, adapters = setup
    ids, _ = reference(base, adapters["a"], PROMPTS[0])
    run = subprocess.run([sys.executable, "-m", "triton_tlaloc.cli", "run", str(art),
                          "--prompt-ids", ",".join(map(str, PROMPTS[0])), "--max-new-tokens",
                          str(STEPS), "--ignore-eos", "--json", "--lora", str(adapters["a"])],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout)["generated_ids"] == ids
    assert "written into slot 1" in run.stderr


def test_what_cannot_take_adapters_is_refused_by_name(tiny, setup, tmp_path):
    base, art, adapters = setup
    for family, what in (("qwen3_5_text", "linear-attention layers"),
                         ("qwen3_moe", "mixtures of experts")):
        with pytest.raises(ExportError, match=f"--max-lora-rank 8: adapters on {what}"):
            export_artifact(tiny.checkpoint(family, False), tmp_path / family,
                            ExportOptions(**OPTS))
    assert not any(tmp_path.iterdir())
    rt_layout = json.loads((art / "tlaloc-serving.json").read_text())["model"]["lora"]
    from triton_tlaloc.lora.layout import LoraLayout
    small = LoraLayout.from_json({**rt_layout, "maxRank": 4})
    with pytest.raises(AdapterError, match=r"has rank [68], over the artifact.s largest 4"):
        read_peft_adapter(adapters["b"], small)


def test_adapter_rows_beside_another_adapters_prompt_in_mixed_calls(tiny, setup, monkeypatch):
    """Rows of adapter a and of none decode while a prompt of adapter b runs in chunks in the
    same mixed calls (each group its own slots): every one keeps transformers + PEFT's greedy
    ids, and the prompt's last logits are its reference's within TOL. Control: the chunk given
    the first decode row's slot (the groups' slots one off) fails the tolerance."""
    from triton_tlaloc.engine import core, steps

    base, _, adapters = setup
    art = tiny.artifact("llama", False, **OPTS, mixed_tokens=(16,))
    rt = Runtime(art)
    read = {name: read_peft_adapter(path, rt.artifact.lora) for name, path in adapters.items()}
    for slot, name in ((1, "a"), (2, "b")):
        rt.adapters.write(slot, read[name].arrays)
    engine = Engine(rt)
    (ids_a, _), (ids_b, first_b), (ids_none, _) = (
        reference(base, adapters[n], p) if n else reference(base, None, p)
        for n, p in (("a", PROMPTS[0]), ("b", PROMPTS[1]), (None, PROMPTS[2])))

    def run():
        seqs = []
        for prompt, slot in ((PROMPTS[0], 1), (PROMPTS[2], 0)):
            s = engine.new_sequence(prompt)
            s.adapter_slot = slot
            s.token_ids.append(int(np.argmax(engine.prefill_chunked(s)[0])))
            seqs.append(s)
        chunked = engine.new_sequence(PROMPTS[1])  # 23 tokens: two mixed calls of 16
        chunked.adapter_slot = 2
        while chunked.uncached:
            out = engine.mixed(seqs, chunked, 16)
            assert engine.last_entry.startswith("mixed_b4_")
            for k, s in enumerate(seqs):
                s.token_ids.append(int(np.argmax(out[k])))
        last = out[-1]
        chunked.token_ids.append(int(np.argmax(last)))
        together = seqs + [chunked]
        while len(chunked.token_ids) < len(PROMPTS[1]) + STEPS:
            out = engine.decode(together)
            for k, s in enumerate(together):
                s.token_ids.append(int(np.argmax(out[k])))
        got = [s.token_ids[len(p):len(p) + STEPS]
               for s, p in zip(together, (PROMPTS[0], PROMPTS[2], PROMPTS[1]))]
        for s in together:
            engine.free(s)
        return got, last

    got, last = run()
    assert got == [ids_a, ids_none, ids_b]
    assert logits_error(last, first_b) <= TOL

    def chunk_one_off(*args):
        step = steps.build_mixed_step(*args)
        step["LORA_SLOTS"][-1] = step["LORA_SLOTS"][0]
        return step

    monkeypatch.setattr(core, "build_mixed_step", chunk_one_off)
    _, wrong = run()
    assert logits_error(wrong, first_b) > TOL

"""The vLLM worker's runner (vllm_plugin/runner.py) over the fake runtime, driven as vLLM's
scheduler drives it: prompts in chunks beside decode rows, a prefix-cache hit, a preemption.
Each request gets the engine's greedy ids, and every position's KV lands in the page vLLM gave
it (control: the check catches KV looked for in other pages). And what does not fit vLLM's
settings or a request is refused by name (vllm_plugin/fit.py). No vLLM imported."""

from __future__ import annotations

from types import SimpleNamespace

from checks.fakes import FakeRuntime, fake_artifact

from triton_tlaloc.engine.core import Engine
from triton_tlaloc.kv.page_pools import FULL
from triton_tlaloc.vllm_plugin.fit import artifact_refusals, request_refusals
from triton_tlaloc.vllm_plugin.runner import ArtifactRunner

BS = 8
A = [1, 17, 99, 3, 200, 41, 7, 88, 5, 60]
B = [(i * 37 + 11) % 250 + 3 for i in range(70)]


def engine_ids(prompt, steps):
    return Engine(FakeRuntime(fake_artifact())).generate_greedy(prompt, steps).generated_ids


def kv_in_pages(rt, state) -> bool:
    """Whether each computed position's token is in the request's page for it."""
    kv = rt.kv[FULL]
    return all(kv[state.pages[p // BS], p % BS] == state.tokens[p] for p in range(state.computed))


class Pages:
    """vLLM's block pool as the scheduler hands it out: page 0 kept back."""

    def __init__(self):
        self.next = 1

    def take(self, n):
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def grow(runner, pages, rid, n):
    """The pages vLLM adds so `rid` holds n more positions."""
    st = runner.requests[rid]
    need = -(-(st.computed + n) // BS) - len(st.pages)
    return pages.take(need) if need > 0 else None


def test_chunked_prompts_beside_decode_rows_give_the_engines_ids_in_vllms_pages():
    rt = FakeRuntime(fake_artifact())
    runner, pages = ArtifactRunner(rt), Pages()
    runner.add("a", A, pages.take(2), 0)
    runner.add("b", B, pages.take(4), 0)
    got = {"a": [], "b": []}
    schedule = [{"a": 10, "b": 32}, {"a": 1, "b": 32}, {"a": 1, "b": 6}]
    for _ in range(8):
        schedule.append({"a": 1, "b": 1})
    for step in schedule:
        for rid, n in step.items():
            st = runner.requests[rid]
            if st.computed:  # a running request's next step: its new pages
                runner.update(rid, st.computed, grow(runner, pages, rid, n))
        for rid, new in zip(step, runner.step(step)):
            got[rid] += new
    assert got["a"] == engine_ids(A, 11) and got["b"] == engine_ids(B, 9)
    # the first step's two prompts in one prefill call; later, 2 decode rows a call
    assert rt.calls[0] == ("prefill_b2_c32", 2) and ("decode_b2_c128", 2) in rt.calls
    for rid in ("a", "b"):
        assert kv_in_pages(rt, runner.requests[rid])
    moved = runner.requests["b"]
    moved.pages = moved.pages[1:] + moved.pages[:1]  # control: other pages than those written
    assert not kv_in_pages(rt, moved)


def test_a_prefix_cache_hit_and_a_preemption_compute_only_what_is_missing():
    rt = FakeRuntime(fake_artifact())
    runner, pages = ArtifactRunner(rt), Pages()
    runner.add("b", B, pages.take(9), 0)
    assert runner.step({"b": 70}) == [[engine_ids(B, 1)[0]]]
    # c shares b's first 64 positions (8 full blocks, vLLM's hit) and computes only the rest
    c = B[:64] + [7, 8, 9]
    runner.add("c", c, runner.requests["b"].pages[:8] + pages.take(1), 64)
    calls = len(rt.calls)
    assert runner.step({"c": 3}) == [[engine_ids(c, 1)[0]]]
    assert rt.calls[calls:] == [("prefill_b1_c128_t32", 1)]
    assert kv_in_pages(rt, runner.requests["b"]) and kv_in_pages(rt, runner.requests["c"])
    # c preempted (its pages given back), resumed with new pages and its whole history
    history = runner.requests["c"].tokens
    runner.update("c", 0, pages.take(9), resumed=True, tokens=history)
    assert runner.step({"c": len(history)}) == [[engine_ids(c, 2)[1]]]
    assert kv_in_pages(rt, runner.requests["c"])
    runner.finish("c")
    assert "c" not in runner.requests


def test_what_does_not_fit_vllms_settings_is_refused_by_name():
    art = fake_artifact(context_ladder=(32, 128))
    assert artifact_refusals(art, block_size=None, max_model_len=128) == []
    assert artifact_refusals(art, block_size=8, max_model_len=32) == []
    wrong = artifact_refusals(art, block_size=16, max_model_len=100, tensor_parallel=2,
                              lora=True, speculative=True)
    assert [w.split(":")[0].split(" ")[0] for w in wrong] == ["block", "max", "tensor", "LoRA",
                                                              "speculative"]
    assert "--block-size 8" in wrong[0] and "[32, 128]" in wrong[1]
    rings = artifact_refusals(fake_artifact(window=8, ring_pages=2, window_blocks=17),
                              block_size=None, max_model_len=128)
    assert len(rings) == 1 and "sliding-window rings" in rings[0]
    state = artifact_refusals(fake_artifact(state_slots=4), block_size=None, max_model_len=128)
    assert len(state) == 1 and "linear-attention state slots" in state[0]


def test_what_a_request_asks_that_the_worker_cannot_give_is_refused_by_name():
    greedy = dict(temperature=0.0, logprobs=None, prompt_logprobs=None)
    assert request_refusals(SimpleNamespace(**greedy)) == []
    # what the worker's sampler gives (vllm_plugin/sampling.py)
    assert request_refusals(SimpleNamespace(**{**greedy, **dict(
        temperature=0.7, top_p=0.9, top_k=5, seed=3, logprobs=2, presence_penalty=0.5,
        frequency_penalty=0.2, repetition_penalty=1.1, structured_outputs={"json": {}},
        logit_bias={3: 1.0}, min_p=0.1, min_tokens=4, allowed_token_ids=[3],
        bad_words=["x"], prompt_logprobs=2)}), verify_tokens=(3, 5, 9)) == []
    # the prompt's logprobs need verify entries (the logits after every position)
    refused = request_refusals(SimpleNamespace(**{**greedy, "prompt_logprobs": 1}))
    assert len(refused) == 1 and "prompt_logprobs" in refused[0]
    assert "--verify-tokens" in refused[0]


def test_a_grammar_bitmask_leaves_exactly_its_tokens_on_its_rows():
    """vLLM's structured-output bitmask (xgrammar's layout: bit j of word k allows token
    32k + j) on the rows it names, in its order; the other rows untouched. Control: the bits
    read most significant first allow other tokens."""
    import numpy as np

    from triton_tlaloc.vllm_plugin.runner import mask_rows

    rng = np.random.default_rng(0)
    vocab, rows = 100, ["a", "b", "c"]
    allowed = {"c": rng.choice(vocab, 7, replace=False), "a": rng.choice(vocab, 30, replace=False)}
    bitmask = np.zeros((2, 4), dtype=np.int32)  # rows in vLLM's order: c, a
    for k, rid in enumerate(("c", "a")):
        for t in allowed[rid]:
            bitmask[k, t // 32] |= np.array(1 << (t % 32), dtype=np.uint32).view(np.int32)
    logits = rng.standard_normal((3, vocab)).astype(np.float32)
    masked = logits.copy()
    mask_rows(masked, rows, ["c", "a"], bitmask)
    for i, rid in enumerate(rows):
        finite = set(np.flatnonzero(np.isfinite(masked[i])).tolist())
        assert finite == (set(allowed[rid].tolist()) if rid in allowed else set(range(vocab)))
        assert np.array_equal(masked[i][np.isfinite(masked[i])],
                              logits[i][np.isfinite(masked[i])])
    # control: each word's bits read the other way round
    swapped = np.unpackbits(bitmask.astype("<i4").view(np.uint8), axis=1, bitorder="big")
    assert set(np.flatnonzero(swapped[0]).tolist()) != set(allowed["c"].tolist())


def test_a_request_asking_for_its_prompts_logprobs_gets_every_positions_logits():
    """Its prompt chunks run alone on verify entries (at most the largest's 9 tokens a call),
    the logits after each position kept for the step (the fake's rule: the token after
    position p is (token + p) mod vocab); its ids stay the engine's. A request beside it that
    does not ask keeps the prefill entries and gets none (control)."""
    rt = FakeRuntime(fake_artifact())
    runner, pages = ArtifactRunner(rt), Pages()
    runner.add("a", B, pages.take(4), 0, every_position=True)
    runner.add("b", A, pages.take(2), 0)
    chunks, got = [], []
    for scheduled in ({"a": 32, "b": 6}, {"a": 32, "b": 4}, {"a": 6, "b": 1}, {"a": 1}):
        for rid, n in scheduled.items():
            runner.update(rid, runner.requests[rid].computed, grow(runner, pages, rid, n))
        before = runner.requests["a"].computed
        out = runner.step(scheduled)
        assert set(runner.chunk_logits) == {"a"}
        chunk = runner.chunk_logits["a"]
        assert chunk.shape[0] == scheduled["a"]
        chunks.append((before, chunk.argmax(axis=1).tolist()))
        got += out[0]
    tokens = runner.requests["a"].tokens
    vocab = rt.artifact.model.vocab
    for before, argmax in chunks:
        assert argmax == [(tokens[p] + p) % vocab for p in range(before, before + len(argmax))]
    assert got == engine_ids(B, 2)
    verify = [name for name, _ in rt.calls if name.startswith("verify")]
    assert len(verify) == 4 + 4 + 1  # 32 tokens: 9 + 9 + 9 + 5, twice; then 6
    assert all(rows == 1 for name, rows in rt.calls if name.startswith("verify"))


def test_a_step_of_nothing_runs_nothing_and_keeps_no_chunk():
    rt = FakeRuntime(fake_artifact())
    runner, pages = ArtifactRunner(rt), Pages()
    runner.add("a", A, pages.take(2), 0, every_position=True)
    runner.run({"a": 10})
    assert set(runner.chunk_logits) == {"a"}
    runner.finish("a")
    calls = len(rt.calls)
    assert runner.run({}) == {} and runner.chunk_logits == {} and len(rt.calls) == calls

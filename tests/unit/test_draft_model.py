"""Drafting with a second model (generation/draft_model.py): a sequence cut back
(Request.keep_tokens, Verifier.rewind, BlockManager.truncate) over the fake runtime, whose KV is
readable; the target generation's protocol with its draft sequence over a fake client; and a target
and a draft model, each a real batcher over the simulated runtime, linked through real sockets."""

from __future__ import annotations

import time

import numpy as np
import pytest
from checks.fakes import Harness, KnownModel, fake_artifact, run_generation

from triton_tlaloc.batcher import Batcher
from triton_tlaloc.codes import INVALID_ARG
from triton_tlaloc.generation.draft_model import ModelDrafter
from triton_tlaloc.engine.core import Engine
from triton_tlaloc.generation.local_streams import LocalLoop, LocalStream, StreamSenders
from triton_tlaloc.generation.sampling import SamplingParams, TextStream
from triton_tlaloc.generation.speculative import SpeculativeParams
from triton_tlaloc.generation.link_server import LocalGenerations
from triton_tlaloc.generation.local_generation import Generation, Speculation
from triton_tlaloc.scheduling.policy import BatchPolicy
from triton_tlaloc.runtime.simulated import SimulatedRuntime

PROMPT = [(i * 37 + 11) % 200 + 20 for i in range(20)]


# ------------------------------------------------------------------ a sequence cut back

def _held(h: Harness, seq_id):
    return h.batcher.sequences[seq_id]


def test_a_sequence_cut_back_holds_what_it_kept_and_goes_on():
    """20 tokens and 3 drafts fed one by one (blocks of 8: two registered), then cut back to
    13 and 2 others appended: the call computes the kept positions of the registered block
    again (it is never written over, and stays cached for others) and the new ones; the KV
    holds exactly the tokens kept and appended. A cut short of every registered block keeps
    what is computed."""
    h = Harness(fake_artifact())
    h.step("a", PROMPT, start=True)
    for t in (1, 2, 3):
        assert h.step("a", [t]).error is None
    seq = _held(h, "a")
    assert len(seq.block_hashes) == 2 and seq.num_cached == 23
    registered = seq.pages[1]
    reply = h.step("a", [50, 51], keep_tokens=13)
    assert reply.error is None
    assert seq.token_ids == PROMPT[:13] + [50, 51] and seq.num_cached == 15
    assert h.rt.kv_of(seq) == seq.token_ids
    assert seq.pages[1] != registered and len(seq.block_hashes) == 1
    # the released block is still cached: a prompt with the same 16 tokens takes it
    h.step("b", PROMPT[:16] + [9], start=True)
    assert _held(h, "b").reused == 16 and _held(h, "b").pages[1] == registered
    # a cut inside the block being filled: nothing to compute again
    before = len(h.rt.calls)
    h.step("a", [60])
    h.step("a", [61], keep_tokens=16)
    assert seq.token_ids == PROMPT[:13] + [50, 51, 60, 61] and h.rt.kv_of(seq) == seq.token_ids
    assert [c[0].split("_")[0] for c in h.rt.calls[before:]] == ["decode", "decode"]


@pytest.mark.parametrize("keep", [0, 24])
def test_a_cut_outside_the_sequence_is_refused_by_name_and_changes_nothing(keep):
    h = Harness(fake_artifact())
    h.step("a", PROMPT, start=True)
    h.step("a", [1])
    seq = _held(h, "a")
    before = (list(seq.token_ids), list(seq.pages), seq.num_cached)
    reply = h.step("a", [5], keep_tokens=keep)
    assert reply.code == INVALID_ARG and f"keep_tokens {keep}: expected 1 to 21" in reply.error
    assert (seq.token_ids, seq.pages, seq.num_cached) == before
    assert h.step("a", [2]).error is None  # the sequence goes on


def test_a_linear_attention_sequence_is_not_cut_back():
    h = Harness(fake_artifact(state_slots=4))
    h.step("a", PROMPT, start=True)
    h.step("a", [1])
    reply = h.step("a", [5], keep_tokens=19)
    assert reply.code == INVALID_ARG and "linear-attention" in reply.error
    assert len(_held(h, "a").token_ids) == 21


def test_a_ring_gives_back_only_what_overwrote_nothing_its_window_needs():
    """Window 8, rings of 3 pages of 4 (12 positions): once the ring has wrapped, a cut may
    drop at most 12 - 7 = 5 positions; before it wraps, any."""
    art = fake_artifact(block_size=4, window=8, ring_pages=3, window_blocks=40,
                        num_blocks=80, prefill_tokens=(8,))
    h = Harness(art)
    h.step("a", PROMPT[:10], start=True)
    assert h.step("a", [1], keep_tokens=4).error is None  # not wrapped: 4 of 10 kept
    h.step("a", PROMPT[:16])
    seq = _held(h, "a")
    n = len(seq.token_ids)
    assert n == 21 and seq.num_cached == n
    reply = h.step("a", [7], keep_tokens=n - 6)
    assert reply.code == INVALID_ARG and "no longer holds the window of 8" in reply.error
    assert len(seq.token_ids) == n
    assert h.step("a", [7], keep_tokens=n - 5).error is None
    assert len(seq.token_ids) == n - 4


# ------------------------------------------------------------------ the target's protocol

VOCAB = 64


class FakeDraftClient:
    """A draft model answering at once: it applies each ask to the sequence it holds (and
    checks that what it then holds is the generation's true history), then drafts `draft(held,
    k)`, of which it holds all but the last."""

    def __init__(self, truth: list[int], draft):
        self.truth, self.draft = truth, draft
        self.held: list[int] = []
        self.asks: list[dict] = []
        self.cancelled = []

    def new_id(self) -> int:
        return 7

    def ask(self, draft_id, spec, answer):
        self.asks.append(spec)
        assert 0 <= spec["keep"] <= len(self.held)
        self.held = self.held[:spec["keep"]] + spec["tokens"]
        assert self.held == self.truth[:len(self.held)], "the draft sequence left the history"
        drafts = self.draft(self.held, spec["k"])
        self.held += drafts[:-1]
        answer(drafts, None)

    def cancel(self, draft_id):
        self.cancelled.append(draft_id)


class FakeDrafters:
    def __init__(self, client):
        self.client = client

    def drafter(self, name, prompt, vocab, salt):
        assert name == "draft" and vocab == VOCAB
        return ModelDrafter(self.client, prompt, salt)


def drafting(client, k: int, max_tokens: int):
    """A model that verifies up to 8 drafts, reaching `client` as draft model "draft"; the
    parameters of a generation drafting k a step with it."""
    speculation = Speculation(most_drafts=8, refused=None, vocab=VOCAB, rewinds=True,
                              drafters=FakeDrafters(client))
    return speculation, SamplingParams(max_tokens=max_tokens, speculative=SpeculativeParams(
        method="draft_model", num_draft_tokens=k, adaptive=False))


def generate_drafting(prompt, text, draft, k, max_tokens=40):
    target = KnownModel(prompt, text)
    client = FakeDraftClient(prompt + text, draft)
    speculation, params = drafting(client, k, max_tokens)
    ids, _, _ = run_generation(target, prompt, params, speculation, "draft")
    return ids, target, client


def _right(truth, wrong_every=0):
    """Drafts of the true history, each `wrong_every`-th position of it wrong."""
    def draft(held, k):
        at = len(held)
        return [truth[i] + (1 if wrong_every and i % wrong_every == 0 else 0)
                for i in range(at, min(at + k, len(truth)))]
    return draft


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("kind", ["right", "wrong every 3rd", "random"])
def test_a_generation_drafting_with_a_model_emits_the_greedy_ids(k, kind):
    """Whatever the drafts, the target's greedy ids; the draft sequence always continues the
    true history (FakeDraftClient checks it after every cut); right drafts save calls."""
    rng = np.random.default_rng(k)
    prompt = rng.integers(1, VOCAB - 1, 12).tolist()
    text = rng.integers(1, VOCAB - 1, 60).tolist()
    truth = prompt + text
    draft = {"right": _right(truth), "wrong every 3rd": _right(truth, 3),
             "random": lambda held, k: rng.integers(0, VOCAB, k).tolist()}[kind]
    ids, target, client = generate_drafting(prompt, text, draft, k)
    assert ids == text[:40]
    assert client.cancelled == [7]  # the draft sequence ended with the generation
    assert target.drafted > 0
    if kind == "right":
        assert target.accepted == target.drafted and target.calls <= 2 + -(-39 // (k + 1))
    if kind == "wrong every 3rd" and k > 2:
        assert any(a["keep"] < len(client.held) for a in client.asks)  # cuts happened


def test_a_draft_model_that_fails_leaves_the_generation_decoding_plainly():
    prompt, text = [3, 4, 5], list(range(10, 40))

    def failing(held, k):
        raise AssertionError("not asked")
    target = KnownModel(prompt, text)
    client = FakeDraftClient(prompt + text, failing)
    client.ask = lambda draft_id, spec, answer: answer([], "draft model draft: pool full")
    speculation, params = drafting(client, 4, 20)
    ids, _, gen = run_generation(target, prompt, params, speculation, "draft")
    assert ids == text[:20]
    assert gen.drafter.failed == "draft model draft: pool full" and target.drafted == 0


def test_draft_model_speculation_is_refused_by_name_without_a_draft_model():
    params = SamplingParams(speculative=SpeculativeParams(method="draft_model"))
    speculation = Speculation(most_drafts=8, refused=None, vocab=VOCAB, rewinds=True)
    for name, says in (("", "names no draft model"), ("draft", "reaches no draft model")):
        with pytest.raises(Exception, match=says):
            Generation(1, [1, 2], params, set(), 64, print, print, speculation, name)


# ------------------------------------------------------------------ through real sockets

ART = fake_artifact(batch_ladder=(1, 4), context_ladder=(64,), block_size=8, num_blocks=200)
SERVER_PID = 4_000_000_001


class WrongEveryThird(SimulatedRuntime):
    """The simulated model, wrong at every third position: a draft model that agrees with
    the target on two tokens in three."""

    def run(self, entry_name, step):
        logits = super().run(entry_name, step)
        last = step["POSITIONS"][:, -1]
        return np.where((last % 3 == 0)[:, None], np.roll(logits, 1, axis=-1), logits)


class Model:
    """A sequence model: a batcher over a simulated runtime, with its local link listening."""

    def __init__(self, name: str, runtime):
        self.rt = runtime
        self.batcher = Batcher(Engine(runtime, prefix_reuse=True),
                               BatchPolicy(prefill_wait_s=0.001))
        self.requests = []  # what its local link submitted

        def submit(requests):
            self.requests += requests
            self.batcher.submit_group(requests)
        self.local = LocalGenerations(name, submit, runtime.artifact.max_context, SERVER_PID,
                                      Speculation.of(self.batcher.engine))
        self.batcher.round_listeners.append(self.local.round_ended)
        self.batcher.start()

    def stop(self):
        self.batcher.stop()
        self.local.stop()


@pytest.fixture
def models(private_tmp):
    made = {"target": Model("target", SimulatedRuntime(ART, 0.001)),
            "right": Model("right", SimulatedRuntime(ART, 0.0005)),
            "partly": Model("partly", WrongEveryThird(ART, 0.0005)),
            "other_vocab": Model("other_vocab", SimulatedRuntime(
                fake_artifact(vocab=128, context_ladder=(64,)), 0.0005))}
    yield made
    for m in made.values():
        m.stop()


def _generate(models, draft_model: str, params_list, prompts):
    """Streams of the target's generate model whose loop drafts with `draft_model`."""
    finals = {}
    outs: dict[int, list] = {}

    def sent(stream, out):
        outs.setdefault(id(stream), []).append(out)
        if out.final:
            finals[id(stream)] = out
    senders = StreamSenders(1, sent, lambda s: False, lambda s: None)
    loop = LocalLoop("target", senders, lambda s, now: None, lambda s: None, SERVER_PID,
                     draft_model=draft_model)
    assert loop.connected()
    streams = [LocalStream(None, p, sp, True, TextStream(lambda ids: "", ()), set(),
                           time.perf_counter()) for p, sp in zip(prompts, params_list)]
    try:
        loop.start(streams)
        for _ in range(3000):
            if len(finals) == len(streams):
                break
            time.sleep(0.01)
    finally:
        loop.close()
        senders.stop()
    return [outs[id(s)] for s in streams]


def _alone(prompt, n):
    return Engine(SimulatedRuntime(ART, 0.0)).generate_greedy(prompt, n).generated_ids


def _drafting(k: int, **extra) -> SamplingParams:
    return SamplingParams(max_tokens=24, ignore_eos=True, **extra, speculative=SpeculativeParams(
        method="draft_model", num_draft_tokens=k, adaptive=False))


def _released(model: Model) -> bool:
    for _ in range(300):
        if not model.batcher.sequences:
            return True
        time.sleep(0.01)
    return False


@pytest.mark.parametrize("draft", ["right", "partly"])
def test_a_target_drafting_with_a_draft_model_gets_its_greedy_ids(models, draft):
    """Two streams drafting with a draft model (4 and 8 drafts) beside a plain one, through
    the sockets: each gets its greedy ids alone. A draft model that is the target's twin
    drafts only right tokens; one wrong at every third position has drafts rejected, and its
    sequences are cut back. The simulated model's token depends on the position, so a draft
    sequence not cut back exactly to the history drafts nothing right: 28 of 88 drafts stood
    here, none of 100 with the cuts left out. Every sequence on both models is released at
    the end."""
    prompts = [PROMPT[:9], PROMPT[3:15], PROMPT[:5]]
    params = [_drafting(4), _drafting(8), SamplingParams(max_tokens=24, ignore_eos=True)]
    outs = _generate(models, draft, params, prompts)
    for prompt, stream_outs in zip(prompts, outs):
        assert stream_outs[-1].finish == "length", stream_outs[-1]
        assert [t for o in stream_outs for t in o.token_ids] == _alone(prompt, 24)
    stats = models["target"].batcher.stats
    cuts = [r for r in models[draft].requests if r.keep_tokens is not None]
    assert stats.drafted > 0
    if draft == "right":
        assert stats.accepted == stats.drafted and not cuts
    else:
        assert 0.2 * stats.drafted < stats.accepted < stats.drafted and len(cuts) > 3
    assert _released(models["target"]) and _released(models[draft])


def test_a_sampled_generation_at_top_k_1_drafting_with_a_model_is_greedy(models):
    outs = _generate(models, "partly", [_drafting(4, temperature=0.9, top_k=1, seed=3)],
                     [PROMPT[:9]])
    assert [t for o in outs[0] for t in o.token_ids] == _alone(PROMPT[:9], 24)


@pytest.mark.parametrize("draft,says", [
    ("missing", "draft model missing cannot be reached"),
    ("other_vocab", "has a vocabulary of 128 tokens, this model 256")])
def test_a_draft_model_that_cannot_draft_is_refused_by_name_in_one_response(models, draft,
                                                                             says):
    outs = _generate(models, draft, [_drafting(4)], [PROMPT[:9]])
    assert len(outs[0]) == 1 and outs[0][0].final
    code, message = outs[0][0].error
    assert code == INVALID_ARG and says in message and "speculative.method draft_model" in message
    assert _released(models["target"])

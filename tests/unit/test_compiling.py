"""Entries compiled in the background: which a model needs before it is ready, the order of
the rest, the compile threads (want moves an entry to the front, wait_for blocks), and the
engine running calls on what is compiled meanwhile (a larger entry, fewer rows per call, or
waiting) with the same replies as when everything is compiled."""

from __future__ import annotations

import threading

import numpy as np
from checks.fakes import FakeRuntime, Harness, fake_artifact

from triton_tlaloc.runtime.compiling import BackgroundCompiler, compile_order, first_entries
from triton_tlaloc.engine.core import Engine, Sequence

ART = fake_artifact(batch_ladder=(1, 2, 4), context_ladder=(32, 128))


def test_a_first_request_needs_two_entries_and_decode_comes_first_at_each_context():
    assert first_entries(ART) == ["decode_b1_c32", "prefill_b1_c32"]
    order = compile_order(ART, [n for n in ART.entries if n not in first_entries(ART)])
    assert len(order) == len(ART.entries) - 2
    assert order[:2] == ["decode_b2_c32", "decode_b4_c32"]
    kinds = [ART.entries[n].kind for n in order]
    verify = kinds.index("verify")
    assert set(kinds[verify:]) == {"verify"}  # speculation's entries after every other
    for part in (order[:verify], order[verify:]):
        contexts = [ART.entries[n].context for n in part]
        assert contexts == sorted(contexts)
    at_128 = [ART.entries[n].kind for n in order if ART.entries[n].context == 128]
    assert at_128.index("prefill") == at_128.count("decode")  # every decode first


def test_want_moves_an_entry_to_the_front_and_wait_for_blocks_until_it_is_compiled():
    gate = threading.Event()
    made, order = {}, []

    def compile_one(name):
        if name == "a":
            gate.wait(5)  # the first compile is under way while the test asks for "d"
        order.append(name)
        return f"exe-{name}"
    c = BackgroundCompiler(["a", "b", "c", "d"], compile_one, made.__setitem__, workers=1)
    c.start()
    c.want("d")
    assert c.pending("d")
    waiter = threading.Thread(target=c.wait_for, args=("d",))
    waiter.start()
    gate.set()
    waiter.join(5)
    assert not waiter.is_alive() and made["d"] == "exe-d"
    assert c.wait_all(5) and order == ["a", "d", "b", "c"] and c.done == 4


def test_a_failed_compile_is_raised_to_whoever_waits_for_it():
    def compile_one(name):
        if name == "b":
            raise MemoryError("out of memory")
    c = BackgroundCompiler(["a", "b"], compile_one, lambda n, e: None).start()
    assert c.wait_all(5)
    try:
        c.wait_for("b")
    except RuntimeError as e:
        assert "entry b failed to compile: out of memory" in str(e)
    else:
        raise AssertionError("waiting for a failed entry must raise")


def replies(rt, prompts, steps=3):
    """Greedy tokens of each prompt decoded together."""
    engine = Engine(rt)
    seqs = [Sequence([]) for _ in prompts]
    logits = []
    for s, p in zip(seqs, prompts):
        engine.admit(s, p)
        logits.append(engine.prefill_chunked(s)[0])
    out = [[] for _ in prompts]
    for _ in range(steps):
        for s, o, lg in zip(seqs, out, logits):
            o.append(int(np.argmax(lg)))
            s.token_ids.append(o[-1])
        logits = list(engine.decode(seqs))
    return out


def test_calls_run_on_what_is_compiled_with_the_same_replies():
    prompts = [list(range(10, 20)), list(range(30, 45)), list(range(50, 52))]
    everything = replies(FakeRuntime(ART), prompts)
    # Only the first entries: three rows decode one at a time on decode_b1 (decode_b4 asked
    # for), nothing waits.
    rt = FakeRuntime(ART, compiling=[n for n in ART.entries if n not in first_entries(ART)])
    assert replies(rt, prompts) == everything
    assert "decode_b4_c32" in rt.wanted and not rt.waited
    assert {e for e, _ in rt.calls} == {"decode_b1_c32", "prefill_b1_c32"}
    # A larger compiled entry serves a smaller call: decode_b4 for two rows.
    rt = FakeRuntime(ART, compiling=["decode_b2_c32"])
    assert replies(rt, prompts[:2]) == everything[:2]
    assert "decode_b2_c32" in rt.wanted and ("decode_b4_c32", 2) in rt.calls


def test_a_call_no_compiled_entry_holds_waits_for_its_entry():
    prompt = list(range(10, 80))  # 70 positions: only the 128 context holds it
    everything = replies(FakeRuntime(ART), [prompt])
    rt = FakeRuntime(ART, compiling=[n for n in ART.entries if n not in first_entries(ART)])
    assert replies(rt, [prompt]) == everything
    assert rt.waited and all(ART.entries[n].context == 128 for n in rt.waited)


def tokens_of(replies) -> list[int]:
    return [int(np.argmax(r.logits)) for r in replies]


def a_long_prompt_and_a_short_conversation(h: Harness, compile_between=None) -> dict:
    """B's 70-token prompt (the 128 context) arrives while A decodes at the 32 context; A's
    next steps run whatever B waits for; `compile_between(h)` is called after them."""
    h.step("A", range(10, 20), start=True)
    h.send("B", range(40, 110), start=True)
    h.clock.advance(1.0)
    h.run()
    for _ in range(3):
        h.step("A", [tokens_of(h.replies["A"])[-1]])
    if compile_between is not None:
        compile_between(h)
    h.clock.advance(1.0)
    h.run()
    for _ in range(3):
        h.step("B", [tokens_of(h.replies["B"])[-1]])
    return {k: tokens_of(v) for k, v in h.replies.items()}


def test_a_call_whose_entry_is_compiling_is_held_back_while_others_run_with_the_same_replies():
    everything = a_long_prompt_and_a_short_conversation(Harness(ART))
    compiling = [n for n in ART.entries if n not in first_entries(ART)]
    h = Harness(ART, compiling=compiling)
    seen = {}

    def while_b_is_held_back(h):
        # B's first 32 tokens ran on the 32-context prefill entry, the rest waits for a
        # 128-context one (asked for); A's four replies came meanwhile, B's none.
        seen["B"] = h.replies.get("B", [])
        seen["B cached"] = h.batcher.sequences["B"].num_cached
        seen["A"] = len(h.replies["A"])
        seen["wanted"] = h.rt.wanted[-1]
        seen["held"] = dict(h.batcher.stats.held_for_compile)
        h.compile(h.rt.wanted[-1])
        h.compile("decode_b1_c128")  # B's steps need it next

    assert a_long_prompt_and_a_short_conversation(h, while_b_is_held_back) == everything
    assert seen["B"] == [] and seen["B cached"] == 32 and seen["A"] == 4
    assert seen["wanted"].startswith("prefill_b1_c128") and seen["held"]["prefill"] == 1
    assert not h.rt.waited  # the batcher's thread never waited for a compile


def test_a_decode_step_past_the_compiled_contexts_is_held_back_and_the_others_decode():
    compiling = [n for n in ART.entries if n not in first_entries(ART)]
    h = Harness(ART, compiling=[n for n in compiling if n != "prefill_b1_c128_t32"])
    h.step("A", range(10, 42), start=True)  # 32 positions: its next step needs context 128
    h.step("B", range(50, 55), start=True)
    h.send("A", [7])
    h.send("B", [8])
    h.clock.advance(1.0)
    h.run()
    assert len(h.replies["A"]) == 1 and len(h.replies["B"]) == 2
    assert h.rt.wanted[-1] == "decode_b1_c128" and h.batcher.held_back_ids() == {"A"}
    h.step("B", [9])  # B goes on; A sends nothing while its step waits
    assert len(h.replies["B"]) == 3 and len(h.replies["A"]) == 1
    h.compile("decode_b1_c128")
    h.run()
    assert len(h.replies["A"]) == 2 and h.last("A").error is None
    assert h.batcher.held_back_ids() == set() and h.rt.calls[-1] == ("decode_b1_c128", 1)


def test_a_held_back_call_whose_compile_fails_is_answered_once_and_rolled_back():
    compiling = [n for n in ART.entries if n not in first_entries(ART)]
    h = Harness(ART, compiling=compiling)
    h.send("B", range(40, 110), start=True)
    h.clock.advance(1.0)
    h.run()
    assert "B" not in h.replies and h.batcher.held_back_ids() == {"B"}
    h.rt.failed.add(h.rt.wanted[-1])
    h.batcher.entries_compiled()  # the compile threads report a failure as they finish
    h.run()
    assert h.last("B").code == "INTERNAL" and "failed to compile" in h.last("B").error
    assert len(h.replies["B"]) == 1 and "B" not in h.batcher.sequences
    assert h.batcher.pool_state()["full"][0] == 0  # every page it held is back


def test_stopping_answers_a_call_held_back_for_a_compile():
    h = Harness(ART, compiling=[n for n in ART.entries if n not in first_entries(ART)])
    h.send("B", range(40, 110), start=True)
    h.clock.advance(1.0)
    h.run()
    assert h.batcher.held_back_ids() == {"B"}
    h.batcher.stop()
    assert h.last("B").code == "UNAVAILABLE" and len(h.replies["B"]) == 1


def test_a_resumed_call_is_busy_so_a_prompt_short_of_pages_does_not_swap_its_sequence_out():
    art = fake_artifact(batch_ladder=(1, 2, 4), context_ladder=(32, 128), num_blocks=17)
    h = Harness(art, host_bytes=1 << 20,
                compiling=[n for n in art.entries if n not in first_entries(art)])
    h.send("B", range(40, 110), start=True)  # 9 of the 16 pages, held back after one chunk
    h.clock.advance(1.0)
    h.run()
    assert h.batcher.held_back_ids() == {"B"}
    h.compile(h.rt.wanted[-1])
    h.send("C", range(120, 200), start=True)  # 10 pages: 3 more than are free
    h.clock.advance(1.0)
    h.run()  # B runs in the round that admits C
    assert h.batcher.sequences["B"].swapped is None
    assert h.last("B").error is None and h.batcher.sequences["B"].num_cached == 70


# An export whose smallest context is larger than its prefill chunk (tlaloc export
# --context-ladder 1024 with chunks of 512): no prefill entry takes a whole context's tokens.
CHUNKED = fake_artifact(batch_ladder=(1, 2), context_ladder=(64, 128), prefill_chunk=16,
                        prefill_tokens=(8,))


def test_the_first_entries_hold_a_prefill_entry_when_prompts_are_chunked():
    assert first_entries(CHUNKED) == ["decode_b1_c64", "prefill_b1_c64"]
    assert CHUNKED.entries["prefill_b1_c64"].tokens_per_seq == 16
    # Control: the rule that asked for a whole context's tokens in one call finds none here.
    assert CHUNKED.smallest_entry("prefill", 1, 64, 64) is None


def test_a_prompt_with_no_prefill_entry_compiled_is_held_back_then_served():
    everything = Harness(CHUNKED)
    everything.step("A", range(10, 50), start=True)  # 40 tokens: three chunks of 16
    everything.step("A", [tokens_of(everything.replies["A"])[-1]])
    want = tokens_of(everything.replies["A"])
    # Nothing compiled but the decode entry: the prompt is held, not failed, and the thread
    # never waits.
    h = Harness(CHUNKED, compiling=[n for n in CHUNKED.entries if n != "decode_b1_c64"])
    h.send("A", range(10, 50), start=True)
    h.send("B", range(60, 70), start=True)
    h.clock.advance(1.0)
    h.run()
    assert "A" not in h.replies and "B" not in h.replies
    assert h.batcher.held_back_ids() == {"A", "B"} and not h.rt.waited
    assert h.batcher.stats.held_for_compile["prefill"] >= 2
    assert h.rt.wanted[0].startswith("prefill_b1_c64")
    h.compile(h.rt.wanted[0])
    h.run()
    assert len(h.replies["A"]) == 1 and h.last("A").error is None
    assert len(h.replies["B"]) == 1 and h.last("B").error is None
    h.step("A", [tokens_of(h.replies["A"])[-1]])
    assert tokens_of(h.replies["A"]) == want


def test_an_engine_that_waits_runs_a_prompt_once_its_prefill_entry_compiles():
    prompt = list(range(10, 50))
    everything = replies(FakeRuntime(CHUNKED), [prompt])
    rt = FakeRuntime(CHUNKED, compiling=[n for n in CHUNKED.entries if n != "decode_b1_c64"])
    assert replies(rt, [prompt]) == everything
    assert rt.waited and rt.waited[0].startswith("prefill_b1_c64")

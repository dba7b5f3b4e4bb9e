"""The host tier over a fake runtime whose "KV" is the token at each slot: a sequence swapped
out and back in holds its own tokens in its new pages (full pages, a ring, a state slot); the
batcher swaps idle sequences out instead of refusing, swaps them back in on their next request,
preempts the most recently admitted when every page is in use, and refuses only past the
deadline or the host budget. Every round the block manager's invariants and every live
sequence's KV are checked."""

from __future__ import annotations

import random

import numpy as np
import pytest
from checks.fakes import FakeRuntime, FakeTransfer, Harness, fake_artifact

from triton_tlaloc.batcher import UNAVAILABLE
from triton_tlaloc.engine.core import Engine, Sequence
from triton_tlaloc.kv.host_tier import HostTier
from triton_tlaloc.kv.page_pools import FULL, STATE, WINDOWED
from triton_tlaloc.pages import PagesExhausted
from triton_tlaloc.scheduling.policy import choose_swap_out

BIG = 1 << 30  # host bytes: more than any test needs


def engine_with_host(art, budget=BIG, prefix_reuse=True):
    rt = FakeRuntime(art)
    engine = Engine(rt, prefix_reuse=prefix_reuse)
    return rt, engine, HostTier(engine.blocks, FakeTransfer(rt), budget)


def run_prompt(engine, seq, tokens):
    engine.admit(seq, tokens)
    engine.prefill_chunked(seq)


def test_a_sequence_swapped_out_and_in_holds_its_own_tokens_in_other_pages():
    rt, engine, host = engine_with_host(fake_artifact(num_blocks=9))  # 8 pages of 8 tokens
    a = Sequence([])
    run_prompt(engine, a, list(range(10, 30)))  # 3 pages
    old_pages = list(a.pages)
    swap = host.swap_out(a)
    assert a.pages == [] and a.swapped is not None and engine.blocks.full.used == 0
    assert swap.pages == 3 and host.used == swap.nbytes == 3 * 8 * 8 and host.sequences == 1
    b = Sequence([])
    run_prompt(engine, b, list(range(100, 124)))  # takes a's old pages (uncached first)
    host.swap_in(a)
    assert host.used == 0 and host.sequences == 0 and a.swapped is None
    assert set(a.pages).isdisjoint(b.pages) and a.pages != old_pages
    assert rt.kv_of(a) == a.token_ids and rt.kv_of(b) == b.token_ids
    a.token_ids.append(7)  # and it goes on where it was
    engine.decode([a])
    assert rt.kv_of(a) == a.token_ids and a.num_cached == 21
    engine.blocks.check([a, b])


def test_pages_written_back_in_the_wrong_order_do_not_hold_the_sequence():
    """The negative control of the check above: the same rows into the pages reversed (no
    prefix reuse, so that every page is written back)."""
    rt, engine, host = engine_with_host(fake_artifact(num_blocks=9), prefix_reuse=False)
    a = Sequence([])
    run_prompt(engine, a, list(range(10, 30)))
    host.swap_out(a)
    host.transfer.write = (lambda write: lambda h, pages: write(h, pages[::-1]))(
        host.transfer.write)
    host.swap_in(a)
    assert rt.kv_of(a) != a.token_ids


def test_leading_blocks_still_cached_on_the_device_are_shared_not_written():
    rt, engine, host = engine_with_host(fake_artifact(num_blocks=17))
    a = Sequence([])
    run_prompt(engine, a, list(range(10, 40)))  # 3 full blocks registered, a 4th partial
    host.swap_out(a)  # its pages are cached now: nothing else asked for them
    swap = host.swap_in(a)
    assert swap.shared == 3 and swap.pages == 1 and swap.nbytes == 1 * 8 * 8
    assert rt.kv_of(a) == a.token_ids
    engine.blocks.check([a])


def test_a_ring_and_a_state_slot_are_swapped_with_the_sequence():
    art = fake_artifact(num_blocks=9, window=16, ring_pages=3, window_blocks=7, state_slots=2)
    rt, engine, host = engine_with_host(art)
    a, b = Sequence([]), Sequence([])
    run_prompt(engine, a, list(range(10, 50)))  # 40 positions: the ring has wrapped
    ring_before = rt.kv[WINDOWED][a.ring].copy()
    state_before = rt.kv[STATE][a.state_slot].copy()
    host.swap_out(a)
    assert a.ring == [] and a.state_slot is None
    run_prompt(engine, b, list(range(60, 80)))  # takes a's ring pages and slot
    host.swap_in(a)
    assert np.array_equal(rt.kv[WINDOWED][a.ring], ring_before)
    assert np.array_equal(rt.kv[STATE][a.state_slot], state_before)
    engine.blocks.check([a, b])


def test_swap_in_is_all_or_nothing():
    rt, engine, host = engine_with_host(fake_artifact(num_blocks=9))
    a, b = Sequence([]), Sequence([])
    run_prompt(engine, a, list(range(10, 34)))  # 3 pages
    host.swap_out(a)
    run_prompt(engine, b, list(range(100, 160)))  # 8 pages: none left
    with pytest.raises(PagesExhausted):
        host.swap_in(a)
    assert a.swapped is not None and a.pages == [] and host.sequences == 1
    engine.blocks.check([b])


def test_choose_swap_out_takes_the_first_that_helps_only_when_they_can_cover():
    cands = [("ring-only", {"windowed": 2}), ("a", {"full": 2}), ("b", {"full": 3})]
    assert choose_swap_out(cands, {"full": 4}) == "a"
    assert choose_swap_out(cands, {"full": 6}) is None  # 5 at most: nobody swapped for nothing
    assert choose_swap_out(cands, {"windowed": 1}) == "ring-only"


# ---------------------------------------------------------------- the batcher


def check_round(h: Harness) -> None:
    live = [s for s in h.batcher.sequences.values() if s.swapped is None]
    h.batcher.engine.blocks.check(live)
    for s in live:
        assert h.rt.kv_of(s) == s.token_ids[:s.num_cached], f"sequence {s.seq_id}"
    host = h.batcher.host
    if host is not None:
        swapped = [s for s in h.batcher.sequences.values() if s.swapped is not None]
        assert host.sequences == len(swapped)
        assert host.used == sum(s.swapped.nbytes for s in swapped)
        assert host.cached_bytes == sum(b.nbytes for b in host.cached.values())
        assert host.used + host.cached_bytes <= host.budget


def next_token(reply) -> int:
    return int(np.argmax(reply.logits))


@pytest.mark.parametrize("host_bytes", [BIG, 0])
def test_an_idle_sequence_is_swapped_out_for_a_new_user_instead_of_a_refusal(host_bytes):
    h = Harness(fake_artifact(num_blocks=9), host_bytes=host_bytes)  # 8 pages
    h.step("a", range(10, 42), start=True)  # 4 pages
    h.step("b", range(50, 82), start=True)  # 4 pages: the pool is full
    reply = h.step("c", range(100, 116), start=True)  # 2 pages
    if host_bytes == 0:  # the control: no host tier, refused as before
        assert reply.code == UNAVAILABLE and "KV pool full" in reply.error
        return
    assert reply.error is None
    seqs = h.batcher.sequences
    assert seqs["a"].swapped is not None and seqs["b"].swapped is None  # a: idle longest
    assert h.batcher.stats.swaps == {"out": 1, "in": 0}
    check_round(h)
    reply = h.step("a", [next_token(h.replies["a"][-1])])  # a again: swapped in (b goes out)
    assert reply.error is None and seqs["a"].swapped is None and seqs["b"].swapped is not None
    assert h.batcher.stats.swaps == {"out": 2, "in": 1}
    check_round(h)
    assert h.step("b", [], end=True).error is None  # END of a swapped-out sequence
    assert h.batcher.host.used == 0 and h.batcher.host.sequences == 0
    check_round(h)


def drive(h: Harness, plans: dict, rounds: int = 400) -> dict:
    """`h.drive` with this module's invariants checked after every round."""
    return h.drive(plans, rounds, check_round)


def test_sequences_outgrowing_the_pool_are_preempted_and_finish_with_their_solo_ids():
    plans = {k: (list(range(10 + 20 * i, 26 + 20 * i)), 30) for i, k in enumerate("abc")}
    solo = drive(Harness(fake_artifact()), plans)  # a pool large enough for all three
    h = Harness(fake_artifact(batch_ladder=(1, 2, 4), num_blocks=11), host_bytes=BIG,
                preempt_wait_s=1000.0)  # 10 pages: 3 sequences of up to 6 pages outgrow it
    assert drive(h, plans) == solo
    stats = h.batcher.stats
    assert stats.preemptions > 0 and stats.swaps["in"] == stats.swaps["out"] > 0
    assert not stats.refusals
    assert h.batcher.host.used == 0 and not h.batcher.sequences


def test_a_request_waits_until_its_deadline_then_is_refused_naming_no_other_sequence():
    h = Harness(fake_artifact(num_blocks=9), host_bytes=BIG, preempt_wait_s=3.0)
    for k, base in (("a", 10), ("b", 50)):  # 4 pages each (25 positions: 7 steps to go)
        h.send(k, range(base, base + 25), start=True)
    h.clock.advance(1)
    h.run()
    h.send("c", range(100, 116), start=True)  # 2 pages; a and b decode in every round
    for _ in range(5):
        for k in "ab":
            h.send(k, [next_token(h.last(k))])
        h.clock.advance(1)
        h.run()
        check_round(h)
        assert all(h.last(k).error is None for k in "ab")  # never preempted for c
    reply = h.last("c")
    assert reply.code == UNAVAILABLE and "waited 3.0 s for pages" in reply.error, reply.error
    assert "sequences hold pages" in reply.error and "'a'" not in reply.error
    assert h.batcher.stats.refusals == {"pages": 1} and h.batcher.stats.swaps["out"] == 0


def test_the_host_budget_spent_refuses_as_before():
    h = Harness(fake_artifact(num_blocks=9), host_bytes=3 * 8 * 8)  # 3 pages of host memory
    h.step("a", range(10, 42), start=True)  # 4 pages: does not fit the host
    h.step("b", range(50, 82), start=True)
    reply = h.step("c", range(100, 116), start=True)
    assert reply.code == UNAVAILABLE and h.batcher.stats.swaps["out"] == 0


def test_a_swapped_out_sequence_triton_has_ended_releases_its_host_memory_unasked():
    h = Harness(fake_artifact(num_blocks=9), host_bytes=BIG, idle_timeout_s=1.0,
                reclaim_allowance_s=0.5)
    h.step("a", range(10, 42), start=True)
    h.step("b", range(50, 82), start=True)
    h.step("c", range(100, 116), start=True)
    assert h.batcher.host.sequences == 1
    h.clock.advance(5.0)
    h.run()
    assert h.batcher.host.sequences == 0 and h.batcher.host.used == 0
    assert "a" not in h.batcher.sequences
    check_round(h)


def test_a_start_on_the_id_of_a_swapped_out_sequence_releases_its_host_copy():
    h = Harness(fake_artifact(num_blocks=9), host_bytes=BIG)
    h.step("a", range(10, 42), start=True)
    h.step("b", range(50, 82), start=True)
    h.step("c", range(100, 116), start=True)
    assert h.batcher.sequences["a"].swapped is not None
    assert h.step("a", range(150, 160), start=True).error is None
    assert h.batcher.sequences["a"].swapped is None
    check_round(h)
    assert h.batcher.host.sequences == len(
        [s for s in h.batcher.sequences.values() if s.swapped is not None])


@pytest.mark.parametrize("shared", [False, True])
def test_random_sessions_on_a_small_pool_keep_every_invariant(shared):
    """16 sessions of random turns, steps, ENDs and abandonment over 12 pages; every round the
    pools' books and every live sequence's KV are checked (check_round); every request is
    answered; nothing is refused; the host comes back to 0 once all have ended. `shared`:
    prompts begin with one of three 16-token prefixes, so evicted blocks spilled to the host
    are found there and written back (and checked like every other KV)."""
    rng = random.Random(7)
    h = Harness(fake_artifact(batch_ladder=(1, 2, 4), num_blocks=13), host_bytes=BIG,
                preempt_wait_s=1000.0)
    prefixes = [[rng.randrange(8, 256) for _ in range(16)] for _ in range(3)]
    state = {}  # id -> [tokens left this turn, waiting for a reply]
    sent = answered = 0
    for step in range(600):
        for k in range(16):
            st = state.get(k)
            if st is not None and len(h.replies.get(k, [])) < st[1]:
                continue  # its reply is not in yet
            if st is None:
                if rng.random() < 0.3:
                    prompt = [rng.randrange(8, 256) for _ in range(rng.randint(1, 20))]
                    if shared:
                        prompt = rng.choice(prefixes) + prompt
                    h.send(k, prompt, start=True)
                    state[k] = [rng.randint(1, 12), len(h.replies.get(k, [])) + 1]
                    sent += 1
                continue
            if st[0] == 0:
                h.send(k, [], end=True)
                state.pop(k)
                sent += 1
                continue
            reply = h.replies[k][-1]
            assert reply.error is None, reply.error
            st[0] -= 1
            h.send(k, [next_token(reply)])
            st[1] += 1
            sent += 1
        h.clock.advance(0.05)
        h.run()
        check_round(h)
    for k in list(state):
        h.send(k, [], end=True)
    h.clock.advance(1)
    h.run()
    h.clock.advance(1)
    h.run()
    answered = sum(len(r) for r in h.replies.values())
    assert answered == sent + len(state)
    assert not h.batcher.stats.refusals
    assert h.batcher.stats.swaps["out"] > 0 and h.batcher.stats.preemptions > 0
    assert h.batcher.host.used == 0 and not h.batcher.sequences
    used, _, _ = h.batcher.pool_state()[FULL]
    assert used == 0
    if shared:  # blocks were spilled, found on the host and written back
        assert h.batcher.host.restored > 0 and h.batcher.stats.prefix_from_host > 0


def converse(h: Harness, chats: dict, rounds: int = 3000) -> dict:
    """Chats of several turns: START with the prompt, then each turn's request is the last
    reply's argmax and the turn's user tokens, followed by `steps` decode steps; the last
    request carries END. A client sends only once its previous reply is in. A chat whose START
    is refused drops out (None); any other refusal fails the test. Returns each chat's argmax
    after every request."""
    out = {k: [] for k in chats}
    plan = {k: [(prompt, True)] + [(turn, False) for turn in turns] for k, (prompt, turns, _) in
            chats.items()}
    todo = {k: sum(1 + steps for _ in turns) + 1 for k, (_, turns, steps) in chats.items()}
    sent = {k: 0 for k in chats}
    for _ in range(rounds):
        for k, (_, turns, steps) in chats.items():
            replies = h.replies.get(k, [])
            if out[k] is None or sent[k] != len(replies) or len(out[k]) == todo[k]:
                continue
            if replies:
                if replies[-1].error is not None:
                    assert sent[k] == 1, f"chat {k}, request {sent[k]}: {replies[-1].error}"
                    out[k] = None  # its START was refused: a new user turned away
                    continue
                out[k].append(next_token(replies[-1]))
                if len(out[k]) == todo[k]:
                    continue
            n = len(out[k])  # requests answered so far
            last = n == todo[k] - 1
            if n == 0:
                h.send(k, plan[k][0][0], start=True)
            elif (n - 1) % (steps + 1) == steps or n == 0:
                turn = plan[k][1 + (n - 1) // (steps + 1)][0]
                h.send(k, [out[k][-1]] + turn, end=last)
            else:
                h.send(k, [out[k][-1]], end=last)
            sent[k] += 1
        h.clock.advance(0.05)
        h.run()
        check_round(h)
        if all(o is None or len(o) == todo[k] for k, o in out.items()):
            return out
    raise AssertionError(f"not finished: {out}")


def test_a_full_host_tier_turns_new_users_away_and_every_admitted_chat_finishes():
    """12 chats of 6 turns on 16 pages and a host tier of 12: the chats admitted outgrow both,
    so sequences idle between turns give up their KV (computed again on their next turn)
    rather than an admitted chat being refused; new STARTs are refused while the host tier is
    full. Every admitted chat gets its solo ids. Control: the chats alone fit (a large pool)."""
    art = dict(batch_ladder=(1, 2, 4), context_ladder=(64, 128), block_size=8)
    chats = {k: ([(7 * k + j) % 200 + 8 for j in range(24)],
                 [[(11 * k + 3 * t + j) % 200 + 8 for j in range(6)] for t in range(6)], 3)
             for k in range(12)}
    solo = converse(Harness(fake_artifact(num_blocks=400, **art)), chats)
    h = Harness(fake_artifact(num_blocks=17, **art), host_bytes=12 * 8 * 8,
                preempt_wait_s=1000.0)
    got = converse(h, chats)
    admitted = [k for k, o in got.items() if o is not None]
    assert len(admitted) >= 4, got
    assert {k: got[k] for k in admitted} == {k: solo[k] for k in admitted}
    stats = h.batcher.stats
    assert stats.refusals == {"pages": len(chats) - len(admitted)}  # STARTs only
    assert stats.recomputes > 0 and stats.swaps["out"] > 0
    assert h.batcher.host.used == 0 and not h.batcher.sequences


def test_a_dropped_sequence_computes_its_history_again_for_any_request():
    """A sequence whose KV was dropped: a verify request is answered as accepting no draft
    (the model's own next token), a call that fails leaves it dropped with its tokens, the next
    request computes it all again (the KV checked), and once Triton would have ended it idle
    it is reclaimed unasked. Control: the same requests on a sequence never dropped verify
    their drafts."""
    for dropped in (True, False):
        h = Harness(fake_artifact(num_blocks=33), host_bytes=BIG, idle_timeout_s=1.0,
                    reclaim_allowance_s=0.5)
        prompt = list(range(10, 30))
        token = next_token(h.step("a", prompt, start=True))  # (29 + 19) % 256
        seq = h.batcher.sequences["a"]
        if dropped:
            h.batcher.engine.drop(seq)
            assert seq.dropped and not seq.pages and seq.token_ids == prompt
        drafts = [(token + 20) % 256, 0]  # the first is the rule's next token, the second not
        reply = h.step("a", [token] + drafts, draft_tokens=2)
        assert reply.error is None and not seq.dropped
        assert reply.accepted_ids == ([(token + 20) % 256] if dropped else
                                      [drafts[0], (drafts[0] + 21) % 256])
        check_round(h)
        length = len(seq.token_ids)
        if dropped:
            h.batcher.engine.drop(seq)
            h.rt.fail_next = RuntimeError("a device fault")
            assert h.step("a", [reply.accepted_ids[-1]]).code == "INTERNAL"
            assert seq.dropped and not seq.pages and len(seq.token_ids) == length
            check_round(h)
        reply = h.step("a", [reply.accepted_ids[-1]])
        assert reply.error is None and len(seq.token_ids) == length + 1
        check_round(h)
        h.batcher.engine.drop(seq)
        h.clock.advance(5.0)
        h.run()
        assert "a" not in h.batcher.sequences

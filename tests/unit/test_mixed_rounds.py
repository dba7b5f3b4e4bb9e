"""Mixed steps in the batcher, over the fake runtime: a prompt that arrives while sequences
decode rides their step in chunks (one token budget per step), never a call of its own that
stalls them; prompts and streams give the ids they give apart; a failed mixed call answers
every row with its error and leaves every sequence as it was."""

from __future__ import annotations

import pytest

from checks.fakes import Harness, fake_artifact
from triton_tlaloc.scheduling.policy import BatchPolicy
from triton_tlaloc.scheduling import round_plan
from triton_tlaloc.scheduling.round_plan import fitted_chunk, mixed_calls

LADDER = dict(batch_ladder=(1, 2, 4), context_ladder=(32, 128), num_blocks=129)


def prompt(n: int, seed: int) -> list[int]:
    return [(seed * 31 + i * 7) % 200 + 3 for i in range(n)]


# Three streams decoding, then prompts of 20 to 90 tokens joining one after another
PLANS = {f"s{k}": (prompt(6 + k, k), 24) for k in range(3)}
PLANS.update({"long": (prompt(90, 7), 10), "mid": (prompt(20, 8), 10), "late": (prompt(45, 9), 6)})
STARTS = {"long": 4, "mid": 5, "late": 12}


def run(mixed_tokens=(), **kw):
    h = Harness(fake_artifact(mixed_tokens=mixed_tokens, **LADDER), **kw)
    out = h.drive(PLANS, starts=STARTS, each_round=lambda h: h.batcher.engine.blocks.check(
        list(h.batcher.sequences.values())))
    return h, out


def test_prompts_joining_mid_flight_give_the_ids_they_give_apart():
    _, apart = run()
    h, mixed = run(mixed_tokens=(8, 16))
    assert mixed == apart
    assert h.rt.mixed_calls, "no prompt rode a decode step"
    assert h.batcher.stats.calls["mixed"] == len(h.rt.mixed_calls)
    # A 90-token prompt needs 6 chunks of 16: it rode six steps
    assert h.batcher.stats.tokens["mixed"] >= 90 + 20 + 45
    # The steps by what they carried, their tokens by part, one wait per prompt
    stats = h.batcher.stats
    assert stats.steps["mixed"] == stats.calls["mixed"]
    assert stats.step_tokens["prompt"] == sum(len(p) for p, _ in PLANS.values())
    assert stats.step_tokens["decode"] == sum(n - 1 for _, n in PLANS.values())
    assert len(stats.prompt_waits_s) == len(PLANS)


def test_no_prompt_call_runs_beside_decoding_streams():
    """While streams decode, every prompt token is computed in a mixed call: no prefill call
    runs in a round that has decode rows."""
    h = Harness(fake_artifact(mixed_tokens=(8, 16), **LADDER))
    kinds_by_round = []

    def each_round(h):
        kinds_by_round.append(list(h.rt.calls[len(sum(kinds_by_round, [])):]))

    h.drive(PLANS, starts=STARTS, each_round=each_round)
    for calls in kinds_by_round:
        names = [name for name, _ in calls]
        if any(n.startswith("decode") or n.startswith("mixed") for n in names):
            assert not any(n.startswith("prefill") for n in names), names
    assert any(n.startswith("mixed") for calls in kinds_by_round for n, _ in calls)


def test_a_long_prompt_alone_runs_a_chunk_a_round():
    """With no stream decoding, a prompt longer than a prefill call runs one chunk per round,
    so a stream that starts meanwhile rides the next chunk instead of waiting for all."""
    h = Harness(fake_artifact(mixed_tokens=(8,), prefill_chunk=32, **LADDER))
    h.send("long", prompt(100, 1), start=True)
    h.clock.advance(1.0)
    assert h.batcher.run_pending()
    assert [n for n, _ in h.rt.calls] == ["prefill_b1_c32"]  # positions 0-31
    assert "long" not in h.replies  # under way: 32 of 100 tokens computed
    assert h.batcher.sequences["long"].num_cached == 32
    h.run()
    assert h.last("long").error is None and h.batcher.sequences["long"].num_cached == 100


def test_mixed_calls_take_the_first_prompt_and_defer_the_others():
    class J:  # what mixed_calls reads of a job
        def __init__(self, n):
            self.seq = type("S", (), {"uncached": [0] * n})()

    decode = [J(1) for _ in range(6)]
    prompts = [J(40), J(5)]
    calls, left, deferred = mixed_calls(decode, prompts, 4, 16)
    assert [(len(c.decode), c.chunk, c.tokens) for c in calls] == [(4, prompts[0], 16)]
    assert left == decode[4:] and deferred == [prompts[1]]
    assert mixed_calls(decode, [J(5)], 4, 16)[0][0].tokens == 5
    assert mixed_calls(decode, prompts, 4, 0) == ([], decode, [])
    assert mixed_calls([], prompts, 4, 16) == ([], [], [])


def test_a_failed_mixed_call_answers_every_row_and_rolls_back():
    h = Harness(fake_artifact(mixed_tokens=(16,), **LADDER))
    for k in ("a", "b"):
        h.step(k, prompt(5, 3), start=True)
    before = {k: (list(h.batcher.sequences[k].token_ids), h.batcher.sequences[k].num_cached)
              for k in ("a", "b")}
    h.rt.fail_next = RuntimeError("device lost")
    h.send("a", [7])
    h.send("b", [8])
    h.send("new", prompt(30, 4), start=True)
    h.clock.advance(1.0)
    h.run()
    assert len(h.rt.mixed_calls) == 0  # it failed before it was recorded
    for k in ("a", "b", "new"):
        assert "mixed call failed: RuntimeError: device lost" in h.last(k).error
    for k in ("a", "b"):
        s = h.batcher.sequences[k]
        assert (list(s.token_ids), s.num_cached) == before[k]
    assert "new" not in h.batcher.sequences
    h.batcher.engine.blocks.check(list(h.batcher.sequences.values()))
    # and the streams go on, a prompt riding their step
    h.send("a", [7])
    h.send("b", [8])
    h.send("new", prompt(30, 4), start=True)
    h.clock.advance(1.0)
    h.run()
    assert all(h.last(k).error is None for k in ("a", "b")) and len(h.replies["new"]) == 1
    # 16 of its 30 tokens rode the step; the rest waits for the streams' next step (their
    # cohort's), and runs alone once that wait is over
    h.run()
    assert len(h.replies["new"]) == 1
    h.clock.advance(1.0)
    h.run()
    assert h.last("new").error is None
    assert h.rt.mixed_calls == [("mixed_b2_c32_t16", 2)]


def test_the_chunk_a_step_carries_is_the_policys_to_cap():
    """mixed_chunk_tokens: the most prompt tokens a step carries beside decode rows (shorter
    stalls, more steps for the prompt); 0 takes the largest mixed entry's."""
    h = Harness(fake_artifact(mixed_tokens=(8, 16), **LADDER), mixed_chunk_tokens=8)
    capped = h.drive(PLANS, starts=STARTS)
    sizes = {name for name, _ in h.rt.mixed_calls}
    assert sizes and all(name.endswith("_t8") for name in sizes), sizes
    _, whole = run(mixed_tokens=(8, 16))
    assert capped == whole
    with pytest.raises(ValueError, match="mixed_chunk_tokens -1"):
        BatchPolicy(mixed_chunk_tokens=-1)
    assert BatchPolicy().chunk_tokens(192) == 192 and BatchPolicy(
        mixed_chunk_tokens=64).chunk_tokens(192) == 64


def test_a_chunk_fills_its_entry_where_that_pads_fewer_tokens(monkeypatch):
    """A step's chunk is the prompt's rest, unless a chunk that fills an entry and then the
    rest pad fewer tokens by more than a call costs; past the cap, the largest entry it
    fills."""
    ladder = [32, 64, 128, 192]
    assert fitted_chunk(158, 192, ladder) == 128  # then 30: 160 tokens computed, not 192
    assert fitted_chunk(160, 192, ladder) == 128
    assert fitted_chunk(190, 192, ladder) == 190  # one call of 192 pads 2
    assert fitted_chunk(100, 192, ladder) == 100  # 128 pads 28, 64 + 64 as many
    assert fitted_chunk(33, 192, ladder) == 33
    assert fitted_chunk(20, 192, ladder) == 20
    assert fitted_chunk(1000, 192, ladder) == 192
    assert fitted_chunk(100, 192, [64, 192]) == 64  # not 100 in an entry of 192
    assert fitted_chunk(158, 192, [64, 192]) == 158  # 64 + 94 would pad more
    # the policy's cap: entries above it still hold the rest (70 pads 58 in 128)
    assert fitted_chunk(70, 100, ladder) == 64 and fitted_chunk(1000, 100, ladder) == 64
    assert fitted_chunk(50, 192, []) == 50
    # a second call is worth its cost only past what it saves: 14 tokens whole in 30 pad 16,
    # 10 then 4 pad 6 in two calls
    assert fitted_chunk(14, 30, [10, 30]) == 14 and fitted_chunk(14, 30, [10, 30], 0) == 10
    # Through the batcher: prompts split that way give the ids they give apart, and their
    # chunks pad fewer tokens than each rest whole does (mid's 20 tokens: 16 then 4, not 64)
    _, apart = run()

    def padded_tokens(h):
        return sum(int(name.rsplit("_t", 1)[1]) for name, _ in h.rt.mixed_calls)

    h, fitted = run(mixed_tokens=(8, 16, 64))
    assert fitted == apart
    monkeypatch.setattr(round_plan, "CALL_TOKENS", 10 ** 6)  # every rest whole
    whole, ids = run(mixed_tokens=(8, 16, 64))
    assert ids == apart and padded_tokens(h) < padded_tokens(whole)


def test_a_prompt_between_the_streams_steps_waits_for_their_next_step():
    """A prompt that comes due while the decoding streams' next requests are still on their
    way waits for them (the cohort's wait at most) and rides their step; with no stream
    expected it runs at once."""
    h = Harness(fake_artifact(mixed_tokens=(16,), **LADDER))
    for k in ("a", "b"):
        h.step(k, prompt(5, 3), start=True)
    for k in ("a", "b"):  # they decode together: a cohort
        h.send(k, [7])
    h.clock.advance(1.0)
    h.run()
    h.send("new", prompt(12, 4), start=True)
    h.clock.advance(0.005)  # due (prefill_wait 2 ms), within the cohort's wait (20 ms)
    h.run()
    assert "new" not in h.replies and len(h.rt.mixed_calls) == 0
    for k in ("a", "b"):
        h.send(k, [8])
    h.run()
    assert h.rt.mixed_calls == [("mixed_b2_c32_t16", 2)] and h.last("new").error is None
    # past the cohort's deadline, a prompt alone runs alone
    h.send("late", prompt(12, 5), start=True)
    h.clock.advance(1.0)
    h.run()
    assert h.last("late").error is None and len(h.rt.mixed_calls) == 1

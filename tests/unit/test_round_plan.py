"""The batcher decides a round, then runs it (scheduling/round_plan.py): `schedule` admits the round's
requests and returns the plan, calls grouped, what room making did, decode steps held back for
a compile, and nothing run; `execute` runs exactly the plan's calls. Control: with one context
bucket the same prompts would share a call, so the plan's split is the buckets' doing."""

from __future__ import annotations

from checks.fakes import Harness, fake_artifact

from triton_tlaloc.scheduling.admission import Request
from triton_tlaloc.scheduling.round_plan import bucket_calls

BIG = 1 << 30


def requests(h: Harness, *specs) -> list[Request]:
    """(id, tokens, start) requests whose replies land in h.replies."""
    out = []
    for seq_id, tokens, start in specs:
        def reply_fn(reply, seq_id=seq_id):
            h.replies.setdefault(seq_id, []).append(reply)
        out.append(Request(seq_id, list(tokens), start, False, reply_fn))
    return out


def test_a_round_is_planned_then_run_as_planned():
    h = Harness(fake_artifact(batch_ladder=(1, 2, 4), context_ladder=(32, 128),
                              prefill_chunk=64))
    for k in "abcde":  # five held sequences, one page each
        h.step(k, [ord(k), 1, 2], start=True)
    before = len(h.rt.calls)
    plan = h.batcher.schedule(requests(
        h, *[(k, [5], False) for k in "abcde"],  # a decode step each
        ("p", range(10, 30), True),  # a prompt for the 32 bucket
        ("q", range(10, 50), True),  # one for the 128 bucket
        ("r", range(10, 80), True)))  # longer than a prefill call takes (64): alone
    assert len(h.rt.calls) == before  # nothing ran
    assert plan.rows("decode") == [["a", "b", "c", "d"], ["e"]]  # the largest decode batch
    assert plan.rows("prefill") == [["p"], ["q"], ["r"]]
    assert not plan.verify and not plan.held_back and not plan.moves
    h.batcher.execute(plan)
    ran = h.rt.calls[before:]
    assert [rows for _, rows in ran[:2]] == [4, 1]  # the decode calls, as planned
    assert all(h.last(k).error is None for k in "abcdepqr")
    # The control: one bucket for everything merges p and q into one call.
    assert [[j.seq.seq_id for j in c] for c in bucket_calls(
        [j for c in plan.prefill[:2] for j in c], 4, [128])] == [["p", "q"]]


def test_the_plan_says_what_room_making_did_and_what_waits_for_a_compile():
    h = Harness(fake_artifact(num_blocks=9), host_bytes=BIG)  # 8 pages
    h.step("a", range(10, 42), start=True)  # 4 pages
    h.step("b", range(50, 82), start=True)  # the pool is full
    h.clock.advance(1.0)
    plan = h.batcher.schedule(requests(h, ("c", range(100, 116), True)))
    assert plan.moves == [("swapped out", "a")] and plan.rows("prefill") == [["c"]]
    h.batcher.execute(plan)
    plan = h.batcher.schedule(requests(h, ("a", [7], False)))
    assert plan.moves == [("swapped out", "b"), ("swapped in", "a")]
    h.batcher.execute(plan)
    art = fake_artifact()
    h = Harness(art, compiling=[n for n in art.entries if n.startswith("decode")])
    h.step("x", range(10, 20), start=True)  # its prompt runs; its decode entry compiles
    plan = h.batcher.schedule(requests(h, ("x", [3], False)))
    assert [(j.seq.seq_id, e) for j, e in plan.held_back] == [("x", "decode_b1_c32")]
    assert not plan.decode
    h.batcher.execute(plan)
    assert h.batcher.held_back_ids() == {"x"}

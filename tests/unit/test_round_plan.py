"""The batcher decides a round, then runs it (scheduling/round_plan.py): `schedule` admits the round's
requests and returns the plan, calls grouped, what room making did, decode steps held back for
a compile, and nothing run; `execute` runs exactly the plan's calls. Control: with one context
bucket the same prompts would share a call, so the plan's split is the buckets' doing."""

from __future__ import annotations

from checks.fakes import Harness, fake_artifact

from triton_tlaloc.scheduling.admission import Request
from triton_tlaloc.scheduling.round_plan import bucket_calls, forced_rows_to_decode

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


def test_forced_rows_join_the_decode_call_when_a_verify_call_beside_it_costs_more():
    """A row of a grammar's forced tokens alone runs in a verify call when that yields more
    tokens a second (alone; the CPU's times: a verify call of 5 tokens 49 ms, decode 23 ms at
    1 row and 49 ms at 4), and joins the decode call when three rows decode beside it (the
    verify call would hold them back 49 ms for 3 tokens more). Speculation's rows, unmeasured
    calls and rounds without decode rows are left as they are."""
    def forced(k, drafts=None):
        return Request("f", [1] * (k + 1), False, False, print, draft_tokens=drafts or k,
                       forced_tokens=k)

    def decode(n):
        return [Request(f"d{i}", [1], False, False, print) for i in range(n)]

    times = {("decode", 1, 1): 0.023, ("decode", 2, 1): 0.035, ("decode", 3, 1): 0.045,
             ("decode", 4, 1): 0.049,
             ("verify", 1, 5): 0.049}

    def seconds(kind, rows, tokens):
        return times.get((kind, rows, 5 if kind == "verify" else tokens))

    alone = [forced(3)]
    assert forced_rows_to_decode(alone, seconds) == []  # no decode call to join
    assert forced_rows_to_decode(decode(1) + alone, seconds) == []  # 5 / 72 ms beats 2 / 35
    with_three = decode(3) + alone
    assert forced_rows_to_decode(with_three, seconds) == alone  # 4 / 49 ms beats 7 / 94 ms
    assert forced_rows_to_decode(decode(3) + [forced(3, drafts=5)], seconds) == []
    assert forced_rows_to_decode(with_three, lambda *a: None) == []

"""LoRA adapters through the batcher over a fake runtime: a START's `lora` takes its adapter's
slot for the sequence's life, rows of different adapters (and none) run in the same calls with
their slots, a START waits while every slot is in use and is admitted when a sequence ends (or
refused past the wait), blocks are shared only between sequences of the same adapter; unknown
adapters, a later request naming another adapter and a model without adapter pools are refused
by name, each answered once."""

from __future__ import annotations

from checks.fakes import Harness, fake_artifact

from triton_tlaloc.batcher import INVALID_ARG, UNAVAILABLE
from triton_tlaloc.lora.peft_adapter import LoraAdapter
from triton_tlaloc.lora.registry import AdapterRegistry

PROMPT = list(range(10, 30))  # 20 tokens: two whole blocks of 8


def harness(slots=2, wait_s=10.0):
    writes = []

    def read(path):
        return LoraAdapter(str(path), {}, 4, f"hash-{path.name}")

    def write(slot, arrays):
        writes.append(slot)
        return 0.0

    registry = AdapterRegistry(slots, read, write, 1 << 20)
    for name in ("a", "b", "c"):
        registry.register(name, f"/adapters/{name}")
    h = Harness(fake_artifact(adapter_slots=slots), adapters=registry, preempt_wait_s=wait_s)
    return h, registry, writes


def test_rows_of_different_adapters_run_in_the_same_calls_with_their_slots():
    h, registry, writes = harness()
    h.send("x", PROMPT, start=True, lora="a")
    h.send("y", [1, 2, 3], start=True, lora="b")
    h.send("z", [4, 5, 6], start=True)
    h.clock.advance(1.0)
    h.run()
    assert all(h.last(s).error is None for s in "xyz")
    assert writes == [1, 2]
    seqs = h.batcher.sequences
    assert [seqs[s].adapter_slot for s in "xyz"] == [1, 2, 0]
    for s in "xyz":
        h.send(s, [7])
    h.clock.advance(1.0)
    # the three rows decode in the ladder's calls (batches 2 and 1), each row its slot
    assert h.run() == [("decode_b2_c32", 2), ("decode_b1_c32", 1)]
    assert h.rt.adapter_slots[-2:] == [[1, 2], [0]]
    assert registry.users[1:] == [1, 1]
    h.step("x", [], end=True)  # ended: its slot is given back, its blocks kept
    assert registry.users[1:] == [0, 1] and seqs.get("x") is None


def test_a_start_waits_for_a_slot_and_is_admitted_when_one_is_free():
    h, registry, writes = harness(slots=1)
    assert h.step("x", [1, 2, 3], start=True, lora="a").error is None
    h.send("y", [4, 5, 6], start=True, lora="b")
    h.clock.advance(1.0)
    h.run()
    assert "y" not in h.replies  # waiting: every slot in use
    h.step("x", [], end=True)
    h.run()
    assert h.last("y").error is None and h.batcher.sequences["y"].adapter_slot == 1
    assert writes == [1, 1] and registry.stats.evictions == 1
    # past the wait: refused by name
    h.send("z", [7, 8], start=True, lora="c")
    h.clock.advance(11.0)
    h.run()
    h.clock.advance(11.0)
    h.run()
    assert h.last("z").code == UNAVAILABLE and "adapter slots" in h.last("z").error
    assert len(h.replies["z"]) == 1


def test_blocks_are_shared_only_within_an_adapter():
    h, _, _ = harness()
    assert h.step("x", PROMPT, start=True, lora="a").error is None
    h.step("x", [], end=True)
    assert h.step("y", PROMPT + [40], start=True, lora="b").error is None
    assert h.batcher.sequences["y"].reused == 0
    assert h.step("z", PROMPT + [41], start=True, lora="a").error is None
    assert h.batcher.sequences["z"].reused == 20  # x's ended turn, continued


def test_what_cannot_be_served_is_refused_by_name():
    h, registry, _ = harness()
    r = h.step("x", [1, 2], start=True, lora="nope")
    assert r.code == INVALID_ARG and "unknown adapter 'nope' (loaded: a, b, c)" in r.error
    assert "x" not in h.batcher.sequences and registry.users[1:] == [0, 0]
    assert h.step("y", [1, 2], start=True, lora="a").error is None
    r = h.step("y", [3], lora="b")
    assert r.code == INVALID_ARG and "its adapter is a, set by its START" in r.error
    assert h.batcher.sequences["y"].token_ids == [1, 2]  # untouched
    assert h.step("y", [3], lora="a").error is None  # naming its own is fine
    plain = Harness(fake_artifact())
    r = plain.step("x", [1, 2], start=True, lora="a")
    assert r.code == INVALID_ARG and "this model takes no adapters" in r.error


def test_refused_requests_keep_or_give_back_no_more_than_they_took():
    """A later request refused before it runs (a front end's refusal) leaves its sequence's
    slot taken and its rows on its adapter; a START refused before admission (empty TOKENS)
    holds no slot afterwards."""
    h, registry, _ = harness()
    assert h.step("x", [1, 2, 3], start=True, lora="a").error is None
    r = h.step("x", [4], refusal=("context", "sequence x: TOKENS too long"))
    assert r.code == INVALID_ARG and registry.users[1:] == [1, 0]
    assert h.batcher.sequences["x"].adapter_slot == 1
    h.step("x", [4])
    assert h.rt.adapter_slots[-1] == [1]  # still decoding with its adapter
    r = h.step("y", [], start=True, lora="b")
    assert r.code == INVALID_ARG and "TOKENS is empty" in r.error
    assert registry.users[1:] == [1, 0]


def test_a_bad_admin_command_or_a_failing_admission_costs_only_its_own_request(tmp_path):
    """An adapter load whose path holds a NUL (the system refuses such a path) and one whose
    admission fails unexpectedly are each answered alone, while sequences decode in the same
    rounds: the others get their tokens, the adapters are as they were."""
    h, registry, _ = harness()
    registry.updates_root = tmp_path
    for s in "xy":
        assert h.step(s, [1, 2, 3], start=True).error is None
    h.send("x", [4])
    h.send("admin", [], start=True, end=True, admin={"load": {"name": "e", "path": "a\0b"}})
    h.send("y", [4])
    h.clock.advance(1.0)
    h.run()
    assert h.last("admin").code == INVALID_ARG and "U+0000" in h.last("admin").error
    assert h.last("x").error is None and h.last("y").error is None
    assert registry.names == ["a", "b", "c"]

    def fails(command):
        raise ZeroDivisionError("division by zero")
    registry.update = fails
    h.send("x", [5])
    h.send("admin2", [], start=True, end=True, admin={"unload": "a"})
    h.send("y", [5])
    h.clock.advance(1.0)
    h.run()
    assert h.last("admin2").code == "INTERNAL" and "admitting the request" in h.last(
        "admin2").error
    assert h.last("x").error is None and h.last("y").error is None
    assert [len(h.replies[s]) for s in ("x", "y", "admin", "admin2")] == [3, 3, 1, 1]

"""Page transfer programs (runtime/kv_transfer.py) under the host tier (kv/host_tier.py): a sequence's
pages, ring and state slot swapped out to the host and back into other pages, in place, give
the same KV bytes and the same greedy ids as a sequence never moved. Negative control: pages written back in the
wrong order change the logits."""

from __future__ import annotations

import numpy as np
import pytest

from triton_tlaloc.engine.core import Engine, Sequence
from triton_tlaloc.export import ExportOptions, export_artifact
from triton_tlaloc.kv.host_tier import HostTier
from triton_tlaloc.runtime.kv_transfer import PageTransfer, bucket, transfer_buckets
from triton_tlaloc.kv.page_pools import FULL, STATE, WINDOWED
from triton_tlaloc.runtime.core import Runtime

PROMPT = [(i * 37 + 11) % 240 + 10 for i in range(29)]
STEPS = 8


@pytest.fixture(scope="module")
def artifacts(tiny, work):
    window_opts = dict(batch_ladder=(1, 2), context_ladder=(32, 64), block_size=4,
                       prefill_chunk=8, attention_block=16)
    return {
        "llama f32": tiny.artifact("llama", False),
        "llama fp8 KV": tiny.artifact("llama", False, kv_dtype="fp8"),
        "gemma3_text ring": export_artifact(tiny.window_checkpoint("gemma3_text"),
                                            work / "transfer-gemma3", ExportOptions(**window_opts)),
        "qwen3_5 state slot": tiny.artifact("qwen3_5_text", False, batch_ladder=(1, 2),
                                            context_ladder=(64, 256), block_size=8),
    }


def held(seq) -> dict[str, list[int]]:
    return {FULL: list(seq.pages), WINDOWED: list(seq.ring),
            STATE: [] if seq.state_slot is None else [seq.state_slot]}


def move(engine: Engine, transfer: PageTransfer, seq, wrong_order=False) -> dict:
    """Swap `seq` out to a host tier (its pages read to the host, then released) and back in
    (other pages taken, the host copies written into them). Returns the host copies by pool
    class."""
    old = held(seq)
    host = HostTier(engine.blocks, transfer, 1 << 40)
    host.swap_out(seq)
    copies = dict(seq.swapped.parts)
    write = transfer.write
    if wrong_order:
        transfer.write = lambda h, pages: write(h, pages[::-1])
    try:
        host.swap_in(seq)
    finally:
        transfer.write = write
    for k, pages in held(seq).items():
        assert not pages or pages != old[k], f"{k}: the sequence came back in the same pages"
    assert host.used == 0 and host.sequences == 0
    return copies


def run(engine, transfer=None, wrong_order=False):
    """Greedy ids and each step's logits; with `transfer`, the sequence is moved after the
    prompt and after half the steps."""
    seq = engine.new_sequence(PROMPT)
    logits = [engine.prefill_chunked(seq)[0]]
    for step in range(STEPS):
        if transfer is not None and step in (0, STEPS // 2):
            host = move(engine, transfer, seq, wrong_order)
            for k, h in host.items():  # the new pages hold the same bytes
                back = transfer.read(k, held(seq)[k])
                for name, a in h.arrays.items():
                    same = np.array_equal(back.arrays[name].view(np.uint8), a.view(np.uint8))
                    assert same or wrong_order, f"{k} pool {name}: bytes differ after the move"
        seq.token_ids.append(int(np.argmax(logits[-1])))
        logits.append(engine.decode([seq])[0])
    engine.free(seq)
    return seq.token_ids[len(PROMPT):], logits


def check_moved_sequence(rt: Runtime, order_matters: bool = True) -> None:
    """A sequence moved through the host twice gives the same ids and exactly the same logits,
    every write in place; with `order_matters`, the control: pages written back in the wrong
    order change the logits."""
    engine = Engine(rt)
    transfer = PageTransfer(rt)
    transfer.warm(transfer_buckets(rt.artifact))
    ids, logits = run(engine)
    moved_ids, moved_logits = run(engine, transfer)
    assert moved_ids == ids
    # the same bytes: the same logits, exactly
    assert all(np.array_equal(a, b) for a, b in zip(logits, moved_logits))
    assert transfer.copied == 0 and transfer.in_place > 0, "writes update the pools in place"
    if order_matters:
        _, wrong = run(engine, transfer, wrong_order=True)
        worst = max(float(np.max(np.abs(a - b))) for a, b in zip(logits[1:], wrong[1:]))
        assert worst > 1e-3, "pages written in the wrong order must change the logits"
    engine.blocks.check([])


@pytest.mark.parametrize("name", ["llama f32", "llama fp8 KV", "gemma3_text ring",
                                  "qwen3_5 state slot"])
def test_a_sequence_moved_through_the_host_continues_with_the_same_ids(artifacts, name):
    # a state slot is one row: no order to get wrong
    check_moved_sequence(Runtime(artifacts[name]), order_matters=name != "qwen3_5 state slot")


def test_buckets_are_powers_of_two():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 33)] == [1, 2, 4, 4, 8, 8, 16, 64]


def prompt_logits(engine, prompt):
    """A START of `prompt`: its last-token logits, greedy ids of 4 steps, tokens reused."""
    seq = Sequence([])
    reuse = engine.admit(seq, list(prompt))
    logits = [engine.prefill_chunked(seq)[0]]
    for _ in range(4):
        seq.token_ids.append(int(np.argmax(logits[-1])))
        logits.append(engine.decode([seq])[0])
    return seq, reuse, logits


@pytest.mark.parametrize("name", ["llama f32", "llama fp8 KV"])
def test_a_prefix_evicted_to_the_host_is_written_back_with_the_same_logits(artifacts, name):
    """A shared system prompt's blocks evicted from the device (two prompts take every page)
    are found on the host by the next prompt and written back: its logits are exactly those
    of the same prompt finding them still on the device. Negative control: one block written
    back in place of another changes them (a permutation of whole blocks would not: the keys
    carry their positions, and attention over a full prefix is a sum over all of them)."""
    rt = Runtime(artifacts[name])
    engine = Engine(rt, prefix_reuse=True)
    transfer = PageTransfer(rt)
    transfer.warm(transfer_buckets(rt.artifact))
    host = HostTier(engine.blocks, transfer, 1 << 40)
    system = PROMPT[:24]  # 3 blocks of 8
    first = system + [201, 202]
    follow = system + [203, 204, 205]

    def filled():  # two prompts of 127 tokens take all 32 pages: every cached one is evicted
        fillers = [prompt_logits(engine, [(i * 13 + k) % 240 + 10 for i in range(123)])[0]
                   for k in (1, 2)]
        for s in fillers:
            engine.free(s)

    a, _, _ = prompt_logits(engine, first)
    engine.free(a)
    b, reuse, on_device = prompt_logits(engine, follow)  # found on the device
    assert reuse.reused == 24 and reuse.from_host == 0
    engine.free(b)
    filled()
    assert len(host.cached) >= 3
    c, reuse, from_host = prompt_logits(engine, follow)
    assert reuse.reused == 24 and reuse.from_host == 24
    assert all(np.array_equal(x, y) for x, y in zip(on_device, from_host))
    assert c.token_ids == b.token_ids
    engine.free(c)
    filled()
    restore = host.restore
    host.restore = lambda blocks, pages: restore([blocks[1]] + blocks[1:], pages)
    _, reuse, wrong = prompt_logits(engine, follow)
    assert reuse.from_host == 24
    worst = float(np.max(np.abs(on_device[0] - wrong[0])))
    assert worst > 1e-3, "a block written in place of another must change the logits"
    assert transfer.copied == 0

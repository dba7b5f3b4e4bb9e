"""A row whose logits are not finite publishes none of its sequence's blocks, over the fake
runtime's NaN (checks/fakes.py: a fault makes one row write NaN KV, and any row that reads NaN
KV gets NaN logits): after such a sequence, every later sequence's request is answered, none
reads its KV, whether through the prefix cache, its turn continued, its open block copied or
the host tier's spilled blocks. Negative control: the old publishing (every row's blocks
registered, whatever its logits) fails each of them. And an adapter's blocks are never a base
request's (the root is keyed by the adapter; control: a root that forgets it)."""

from __future__ import annotations

from checks.fakes import NAN_KV, Harness, fake_artifact

from triton_tlaloc.engine import core
from triton_tlaloc.lora.peft_adapter import LoraAdapter
from triton_tlaloc.lora.registry import AdapterRegistry
from triton_tlaloc.pages import BlockManager, block_hash, root_hash

PAGE_BYTES = 8 * 8  # the fake's page: 8 int64 slots
A = list(range(100, 124))  # three whole blocks of 8


def old_publishing(monkeypatch) -> None:
    """Before: a row's blocks were registered whatever its logits held."""
    monkeypatch.setattr(BlockManager, "withhold", BlockManager.register)


def errors_after_a_nan_sequence() -> tuple[dict[str, str | None], Harness]:
    """A sequence whose prompt writes NaN KV, then sequences of the same root that would find
    its KV: each request's error (None: answered), by sequence."""
    h = Harness(fake_artifact(), host_bytes=32 * PAGE_BYTES)
    got = {}

    def step(name, tokens, **kw):
        got[name] = h.step(name, tokens, **kw).error

    # an open block (no whole block yet), recorded by a finite call, then written NaN by a
    # decode step: a prompt continuing into it would copy it
    step("open", [1, 2, 3], start=True)
    h.rt.nan_once = {200}
    step("open", [200])
    step("copies it", [1, 2, 3, 200, 9], start=True)
    # whole blocks: shared from the device pool, then the whole turn continued
    h.rt.nan_once = {100}
    step("nan", A, start=True)
    step("shares its blocks", A[:16] + [7, 8], start=True)
    h.step("nan", [], end=True)
    step("continues its turn", A + [9], start=True)
    for name in ("open", "copies it", "shares its blocks", "continues its turn"):
        h.step(name, [], end=True)
    # two prompts of the whole context: every cached block evicted, to the host tier
    for i in (1, 2):
        step(f"fills the pool {i}", [(i * 131 + j) % 200 + 1 for j in range(128)],
             start=True)
        h.step(f"fills the pool {i}", [], end=True)
    first = block_hash(root_hash(""), A[:8])
    assert h.batcher.engine.blocks.full.page_of(first) is None and first in h.batcher.host.cached
    step("finds them on the host", A[:16] + [4], start=True)
    h.batcher.engine.blocks.check(list(h.batcher.sequences.values()))
    return got, h


def test_no_sequence_reads_the_kv_of_a_sequence_whose_logits_were_not_finite():
    got, h = errors_after_a_nan_sequence()
    assert "NaN" in got.pop("nan") and "NaN" in got.pop("open")
    assert got == {name: None for name in got}, got
    assert h.batcher.stats.nonfinite_rows == {"prefill": 1, "decode": 1, "verify": 0}
    assert h.batcher.host.restored > 0  # the host tier served that prompt: healthy blocks


def test_control_the_old_publishing_serves_its_nan_to_every_path(monkeypatch):
    old_publishing(monkeypatch)
    got, _ = errors_after_a_nan_sequence()
    for name in ("copies it", "shares its blocks", "continues its turn",
                 "finds them on the host"):
        assert got[name] is not None and "NaN" in got[name], (name, got)


def chunked_then_shared() -> tuple[int, Harness]:
    """A prompt in three chunks of 16 whose last chunk writes NaN KV (its first two were
    finite, and registered as they ran); then a prompt sharing those two chunks' blocks: how
    many of its tokens it found cached."""
    h = Harness(fake_artifact(prefill_chunk=16))
    prompt = list(range(50, 90))
    h.rt.nan_once = {85}  # position 35: the third chunk
    assert "NaN" in h.step("nan", prompt, start=True).error
    assert len(h.rt.calls) == 3  # it ran in chunks
    seq = h.step("after", prompt[:32] + [1], start=True)
    assert seq.error is None
    return h.batcher.sequences["after"].reused, h


def test_blocks_an_earlier_chunk_of_the_same_request_published_are_forgotten():
    reused, h = chunked_then_shared()
    assert reused == 0
    assert NAN_KV not in h.rt.kv_of(h.batcher.sequences["after"])


def test_control_the_old_publishing_keeps_the_earlier_chunks_blocks(monkeypatch):
    old_publishing(monkeypatch)
    reused, _ = chunked_then_shared()
    assert reused == 32


def base_after_adapter() -> int:
    """An adapter's prompt ended, then a base prompt with its first two blocks: how many of
    its tokens the base prompt found cached."""
    registry = AdapterRegistry(1, lambda path: LoraAdapter(str(path), {}, 4, "hash-a"),
                               lambda slot, arrays: 0.0, 1 << 20)
    registry.register("a", "/adapters/a")
    h = Harness(fake_artifact(adapter_slots=1), adapters=registry)
    assert h.step("adapter", A, start=True, lora="a").error is None
    h.step("adapter", [], end=True)
    assert h.step("base", A[:16] + [7], start=True).error is None
    return h.batcher.sequences["base"].reused


def test_a_base_prompt_never_reuses_an_adapters_blocks(monkeypatch):
    assert base_after_adapter() == 0
    root_hash = core.root_hash
    monkeypatch.setattr(core, "root_hash", lambda model, salt="", adapter="": root_hash(model,
                                                                                       salt))
    assert base_after_adapter() == 16, "control: a root that forgets the adapter shares them"

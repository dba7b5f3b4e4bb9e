"""A prompt whose cached prefix ends inside a running sequence's open block gets a copy of that
page (kv/open_blocks.py, pages.BlockManager.start) over a fake runtime whose "KV" is the token
at each slot: the copy holds the prompt's positions, the prompt's last token alone is computed,
as a decode row, and the donor writing on into its own page touches nothing of the copy.
An ended sequence kept for its next turn gives copies too, its page held until copied; nothing
is copied from a sequence cut back, freed or of another cache salt, nor without a host tier
(whose page transfers copy). Through the batcher, n starts of one prompt compute it once."""

from __future__ import annotations

import numpy as np
from checks.fakes import FakeRuntime, Harness, fake_artifact
from test_host_tier import BIG, check_round, engine_with_host, next_token, run_prompt

from triton_tlaloc.engine.core import Engine, Sequence
from triton_tlaloc.pages import root_hash

PROMPT = list(range(10, 30))  # 20 tokens: two full blocks of 8, then 4 in an open block


def test_a_prompt_ending_in_a_running_sequences_open_block_copies_its_page():
    rt, engine, host = engine_with_host(fake_artifact(num_blocks=17))
    a, b = Sequence([]), Sequence([])
    run_prompt(engine, a, PROMPT)
    reuse = engine.admit(b, list(PROMPT))
    assert b.pages[:2] == a.pages[:2] and b.pages[2] != a.pages[2]  # shared, then copied
    assert reuse.copied == 3 and b.num_cached == 19 and b.uncached == [29]
    assert host.copied_pages == 1 and engine.blocks.copied == 3
    assert rt.kv_of(b) == PROMPT[:19]
    engine.decode([b])  # its last token, one decode row
    a.token_ids.append(7)
    engine.decode([a])  # a writes on into its own open page
    assert rt.kv_of(b) == b.token_ids and rt.kv_of(a) == a.token_ids
    engine.blocks.check([a, b])


def test_a_prompt_ending_a_block_copies_a_running_sequences_full_block():
    """A prompt of whole blocks: its last block is cached (a running sequence's, registered),
    but its last token must be computed, so that block is copied, not shared; a block only an
    ended sequence holds is not (the reservation may take its page)."""
    prompt = list(range(10, 34))  # three full blocks
    rt, engine, host = engine_with_host(fake_artifact(num_blocks=33))
    a, b = Sequence([]), Sequence([])
    run_prompt(engine, a, prompt)
    reuse = engine.admit(b, list(prompt))
    assert reuse.copied == 7 and b.pages[:2] == a.pages[:2] and b.pages[2] != a.pages[2]
    assert rt.kv_of(b) == prompt[:23]
    engine.decode([b])
    assert rt.kv_of(b) == prompt
    engine.blocks.check([a, b])
    engine.blocks.free(a)
    engine.blocks.free(b)  # the block stays cached, held by none: copied all the same
    c = Sequence([])
    assert engine.admit(c, list(prompt)).copied == 7 and rt.kv_of(c) == prompt[:23]
    engine.blocks.check([c])


def test_a_copy_into_the_wrong_page_does_not_hold_the_prompt():
    """The negative control of the check above: the copy written into the donor's own page."""
    rt, engine, host = engine_with_host(fake_artifact(num_blocks=17))
    host.copy_page = lambda src, dst: None
    a, b = Sequence([]), Sequence([])
    run_prompt(engine, a, PROMPT)
    engine.admit(b, list(PROMPT))
    assert rt.kv_of(b) != PROMPT[:19]


def test_an_ended_sequence_kept_for_its_next_turn_gives_a_copy_held_until_copied():
    """Choice 0 may end before the others start: its page, kept, is copied. The copy's source
    is held from the START until the reservation has copied it (a reservation may drop kept
    sequences for room), then let go; a START refused for pages lets it go too."""
    rt, engine, host = engine_with_host(fake_artifact(num_blocks=5))  # 4 pages of 8
    a, b = Sequence([]), Sequence([])
    run_prompt(engine, a, PROMPT)  # 3 pages
    engine.blocks.finish(a)  # kept whole
    full, source = engine.blocks.full, a.pages[2]
    reuse = engine.blocks.start(b, list(PROMPT), a.root)
    assert reuse.copied == 3 and b.copy_from == source and full.refs[source] == 2
    engine.blocks.unstart(b, reuse)  # refused: the hold goes with it
    assert full.refs[source] == 1 and b.copy_from is None
    reuse = engine.admit(b, list(PROMPT))  # 2 shared, 1 new: the free page
    assert reuse.copied == 3 and rt.kv_of(b) == PROMPT[:19] and full.refs[source] == 1
    engine.decode([b])
    assert rt.kv_of(b) == PROMPT
    engine.blocks.check([b])


def test_nothing_is_copied_from_a_sequence_cut_back_gone_or_of_another_salt():
    art = fake_artifact(num_blocks=33)
    for case in ("cut back", "freed", "salt", "other tokens", "no host tier"):
        rt, engine, host = engine_with_host(art)
        if case == "no host tier":
            rt = FakeRuntime(art)
            engine = Engine(rt, prefix_reuse=True)
        a, b = Sequence([]), Sequence([])
        run_prompt(engine, a, PROMPT)
        prompt = list(PROMPT)
        if case == "cut back":
            engine.blocks.truncate(a, 17)
        elif case == "freed":
            engine.blocks.free(a)
        elif case == "other tokens":
            prompt[17] = 99
        reuse = engine.admit(b, prompt, "tenant" if case == "salt" else None)
        assert reuse.copied == 0 and b.copy_from is None, case
        assert b.num_cached == (0 if case == "salt" else 16), case
        engine.prefill_chunked(b)
        assert rt.kv_of(b) == prompt, case


def test_the_index_forgets_what_stops_running():
    rt, engine, host = engine_with_host(fake_artifact(num_blocks=17))
    a = Sequence([])
    run_prompt(engine, a, PROMPT)
    index = engine.blocks.open_blocks
    parent = a.block_hashes[-1]
    assert index.by_parent[parent] == (a, 2)
    assert index.page_for(parent, a.root, PROMPT[16:19]) == a.pages[2]
    assert index.page_for(parent, root_hash("another model", None), PROMPT[16:19]) is None
    host.swap_out(a)
    assert parent not in index.by_parent and id(a) not in index.keys


def test_n_starts_of_one_prompt_compute_it_once_and_get_the_same_ids():
    """Four STARTs of one prompt through the batcher, the first alone, the others once its
    prompt ran (as tlaloc openai starts n choices): one prefill call; the other three run their
    last token as decode rows, and every sequence's greedy ids are the first's."""
    h = Harness(fake_artifact(num_blocks=65), host_bytes=BIG)
    h.send("c0", PROMPT, start=True)
    h.clock.advance(1.0)
    calls = h.run()
    assert [e.split("_")[0] for e, _ in calls] == ["prefill"], calls
    for i in (1, 2, 3):
        h.send(f"c{i}", PROMPT, start=True)
    h.clock.advance(1.0)
    calls = h.run()
    assert calls and not any(e.startswith("prefill") for e, _ in calls), calls
    assert h.batcher.engine.blocks.copied == 3 * 3
    check_round(h)
    ids = {}
    for name in ("c0", "c1", "c2", "c3"):
        ids[name] = [next_token(h.replies[name][0])]
    for _ in range(5):
        for name in ids:
            h.send(name, [ids[name][-1]])
        h.run()
        for name in ids:
            ids[name].append(next_token(h.replies[name][-1]))
        check_round(h)
    assert len({tuple(v) for v in ids.values()}) == 1
    assert np.array_equal(h.replies["c1"][0].logits, h.replies["c0"][0].logits)

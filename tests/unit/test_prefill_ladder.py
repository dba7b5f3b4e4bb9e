"""The default prefill token ladder: which entries an export writes below a context's largest,
and the entry a prompt then runs in."""

from __future__ import annotations

import pytest
from checks.fakes import fake_artifact

from triton_tlaloc.export.options import ExportOptions, default_prefill_tokens


@pytest.mark.parametrize("context, chunk, ladder", [
    (128, None, [32, 64, 128]),  # the tests' tiny contexts: as before
    (256, None, [32, 64, 128, 192, 256]),
    (4096, 512, [32, 64, 128, 192, 256, 384, 512]),  # `tlaloc export`'s chunk of 512
    (4096, None, [32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096]),
])
def test_the_default_ladder_has_powers_of_two_and_the_steps_between_them_from_192(
        context, chunk, ladder):
    assert ExportOptions(prefill_chunk=chunk).prefill_token_ladder(context) == ladder


def test_what_the_user_asks_for_replaces_the_default():
    assert ExportOptions(prefill_tokens=(100, 200)).prefill_token_ladder(512) == [100, 200, 512]
    assert ExportOptions(prefill_tokens=()).prefill_token_ladder(512) == [512]


@pytest.mark.parametrize("prompt, entry", [(158, "prefill_b1_c512_t192"),  # a chat of 128 + 30
                                           (300, "prefill_b1_c512_t384"),
                                           (120, "prefill_b1_c512_t128"),
                                           (500, "prefill_b1_c512")])
def test_a_prompt_runs_in_the_smallest_step_that_holds_it(prompt, entry):
    opts = ExportOptions(prefill_chunk=512)
    art = fake_artifact(batch_ladder=(1,), context_ladder=(512,),
                        prefill_tokens=default_prefill_tokens(512), verify_tokens=())
    assert opts.prefill_token_ladder(512) == sorted(
        e.tokens_per_seq for e in art.entries.values() if e.kind == "prefill")
    assert art.smallest_entry("prefill", 1, prompt, prompt).name == entry
    # Control: powers of two alone (the ladder before) pad the 158-token chat to 256.
    old = fake_artifact(batch_ladder=(1,), context_ladder=(512,), prefill_tokens=(32, 64, 128, 256),
                        verify_tokens=())
    padded = old.smallest_entry("prefill", 1, prompt, prompt).tokens_per_seq
    assert padded >= art.smallest_entry("prefill", 1, prompt, prompt).tokens_per_seq
    if prompt == 158:
        assert padded == 256

"""One table of the sequence model's parameters (model_parameters.py): docs/parameters.md is
that table; every flag it names is a `tlaloc repository` flag whose default writes the table's
default; RepositoryOptions, the batch policy and the batcher start from the same defaults.
Controls: a changed default is no longer what the docs show, and a flag nobody defines is
caught."""

from __future__ import annotations

import inspect
from dataclasses import replace
from pathlib import Path

from triton_tlaloc import cli
from triton_tlaloc.batcher import Batcher
from triton_tlaloc.model_parameters import BY_NAME, DEFAULTS, PARAMETERS, markdown_table
from triton_tlaloc.scheduling.policy import BatchPolicy
from triton_tlaloc.repository import RepositoryOptions

DOC = Path(__file__).resolve().parents[2] / "docs" / "parameters.md"

# RepositoryOptions field -> the parameter it writes, and how (repository.write_repository)
WRITTEN = {
    "donate_kv_pools": ("donate_kv_pools", lambda v: "true" if v else "false"),
    "cohort_wait_microseconds": ("cohort_wait_microseconds", str),
    "cohort_wait_steps": ("cohort_wait_steps", lambda v: f"{v:g}"),
    "prefill_wait_microseconds": ("prefill_wait_microseconds", str),
    "backend_batching": ("backend_batching", lambda v: "true" if v else "false"),
    "reclaim_allowance_microseconds": ("reclaim_allowance_microseconds", str),
    "prefix_reuse": ("prefix_reuse", lambda v: "true" if v else "false"),
    "expert_load_metrics": ("expert_load_metrics", lambda v: "true" if v else "false"),
    "runtime": ("runtime", str),
    "preempt_wait_microseconds": ("preempt_wait_microseconds", str),
    "background_compile": ("background_compile", lambda v: "true" if v else "false"),
    "reply_threads": ("reply_threads", str),
    "generation_loop": ("local_generation", lambda v: "true" if v == "local" else "false"),
}


def repository_flags() -> dict[str, object]:
    """`tlaloc repository`'s flags and their defaults."""
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command" or a.choices)
    repo = sub.choices["repository"]
    return {s: a.default for a in repo._actions for s in a.option_strings}


def test_the_docs_show_the_table():
    assert markdown_table() in DOC.read_text()
    assert len(PARAMETERS) == len(BY_NAME) == len(DEFAULTS)  # no name twice
    changed = replace(BY_NAME["cohort_wait_microseconds"], default="30000")  # the control
    assert changed.as_row() not in DOC.read_text()


def test_every_flag_exists_and_the_options_start_from_the_table():
    flags = repository_flags()
    named = {p.flag for p in PARAMETERS if p.flag}
    assert named <= set(flags), named - set(flags)
    assert "--no-such-flag" not in flags  # the control: a flag nobody defines is caught
    options = RepositoryOptions()
    for field_name, (param, written) in WRITTEN.items():
        assert written(getattr(options, field_name)) == DEFAULTS[param], field_name
    # Value flags default to the options' values (store_true flags write the non-default)
    assert flags["--cohort-wait-us"] == options.cohort_wait_microseconds
    assert flags["--preempt-wait-us"] == options.preempt_wait_microseconds
    assert flags["--generation-loop"] == options.generation_loop
    assert flags["--max-sequence-idle-us"] == options.max_sequence_idle_microseconds
    policy = BatchPolicy()
    assert round(policy.cohort_wait_s * 1e6) == int(DEFAULTS["cohort_wait_microseconds"])
    assert round(policy.prefill_wait_s * 1e6) == int(DEFAULTS["prefill_wait_microseconds"])
    assert round(policy.reclaim_allowance_s * 1e6) == int(
        DEFAULTS["reclaim_allowance_microseconds"])
    assert policy.idle_timeout_s * 1e6 == options.max_sequence_idle_microseconds
    default_wait = inspect.signature(Batcher.__init__).parameters["preempt_wait_s"].default
    assert round(default_wait * 1e6) == int(DEFAULTS["preempt_wait_microseconds"])

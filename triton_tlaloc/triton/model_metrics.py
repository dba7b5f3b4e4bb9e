"""The sequence model's Prometheus metrics: an observer of the batcher (scheduling/observer.py) whose
updates go through a MetricsWriter, shown on Triton's metrics port. docs/serving.md names them."""

from __future__ import annotations

import numpy as np
import triton_python_backend_utils as pb_utils

from ..generation.token_constraint import GrammarObserver
from ..generation.structured import KINDS
from ..scheduling.observer import Observer
from .metrics import MetricsWriter


class _Family:
    """A MetricFamily whose metrics the writer names (family and labels) in its log lines."""

    def __init__(self, family, name: str, writer: MetricsWriter):
        self.family, self.name, self.writer = family, name, writer

    def Metric(self, labels: dict, **kw):
        text = self.name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
        return self.writer.name(self.family.Metric(labels=labels, **kw), text)


class TritonMetrics(Observer):
    """The batcher's observer: Prometheus metrics on Triton's metrics port (docs/serving.md
    names them). Every metric carries the model's name as a label."""

    WAIT_BUCKETS = [1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0]
    EXEC_BUCKETS = [1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
    SIZE_BUCKETS = [1, 2, 4, 8, 16, 32, 64]

    def __init__(self, model_name: str, interval_s: float = 0.25, instance: str = ""):
        F = pb_utils.MetricFamily
        # An instance's own series: each instance of a model runs in its own process, with its
        # own pools and batcher.
        self.labels = {"model": model_name, **({"instance": instance} if instance else {})}
        # Updates are applied on the writer's thread (triton/metrics.py): each is an IPC round trip.
        self.writer = MetricsWriter(interval_s)
        self.has_histograms = hasattr(F, "HISTOGRAM")

        # A MetricFamily must outlive its Metrics: every family is kept here.
        self.families = []

        def family(name, description, kind):
            self.families.append(F(name=name, description=description, kind=kind))
            return _Family(self.families[-1], name, self.writer)

        pages_used = family("tlaloc_kv_pages_used", "KV pages held by live sequences", F.GAUGE)
        pages_cached = family("tlaloc_kv_pages_cached", "KV pages no live sequence holds that "
                              "keep reusable KV (cached blocks, ended sequences)", F.GAUGE)
        pages_free = family("tlaloc_kv_pages_free", "KV pages free", F.GAUGE)
        self.pages_used = {pool: pages_used.Metric(labels={**self.labels, "pool": pool})
                           for pool in ("full", "windowed")}
        self.pages_cached = {pool: pages_cached.Metric(labels={**self.labels, "pool": pool})
                             for pool in ("full", "windowed", "state")}
        self.pages_free = {pool: pages_free.Metric(labels={**self.labels, "pool": pool})
                           for pool in ("full", "windowed")}
        # A hybrid model's linear-attention state slots (schema v4), one per live sequence.
        self.pages_used["state"] = family(
            "tlaloc_state_slots_used", "Linear-attention state slots held by sequences",
            F.GAUGE).Metric(labels=self.labels)
        self.pages_free["state"] = family(
            "tlaloc_state_slots_free", "Linear-attention state slots free",
            F.GAUGE).Metric(labels=self.labels)
        self.sequences = family("tlaloc_sequences_held", "Live sequences: started, not yet "
                                "ended or reclaimed (swapped out or dropped ones too; not the "
                                "ended ones kept for a next turn)", F.GAUGE).Metric(
            labels=self.labels)
        self._memory = family("tlaloc_device_bytes", "Bytes the model holds on each of its "
                              "devices, by what (weights, kv_pools, state_pools) and device",
                              F.GAUGE)
        self.resident = family("tlaloc_resident_bytes", "Resident memory of the model's "
                               "process (its weights, pools and executables on a CPU device; "
                               "measured at load and as entries compile)", F.GAUGE).Metric(
            labels=self.labels)
        self.entries_compiled = family("tlaloc_entries_compiled", "Entries compiled so far (the "
                                       "rest compile in the background)", F.GAUGE).Metric(
            labels=self.labels)
        self.entries_total = family("tlaloc_entries", "Entries of the artifact", F.GAUGE).Metric(
            labels=self.labels)
        self._executions = family("tlaloc_executions_total", "Entry executions by kind",
                                  F.COUNTER)
        self._tokens = family("tlaloc_tokens_total", "Tokens run, by kind of call "
                             "(prefill, decode, verify)", F.COUNTER)
        self._refusals = family("tlaloc_refusals_total", "Requests refused, by reason",
                                F.COUNTER)
        self._step_tokens = family("tlaloc_step_tokens_total", "Tokens the executions ran, by "
                                   "part of the step (prompt: prefill calls and mixed calls' "
                                   "chunks; decode: decode and verify rows)", F.COUNTER)
        self._steps = family("tlaloc_steps_total", "Executions by what they carried (prompt, "
                             "decode, mixed: a prompt's chunk and decode rows in one)",
                             F.COUNTER)
        self.reclaimed_pages = family("tlaloc_pages_reclaimed_total", "KV pages reclaimed from "
                                      "sequences Triton ended", F.COUNTER).Metric(labels=self.labels)
        self.reclaimed_sequences = family(
            "tlaloc_sequences_reclaimed_total", "Sequences reclaimed after Triton ended them",
            F.COUNTER).Metric(labels=self.labels)
        self.prefix_queries = family(
            "tlaloc_prefix_cache_queries_total", "Prompt tokens of STARTs looked up in the "
            "prefix cache", F.COUNTER).Metric(labels=self.labels)
        self.prefix_hits = family(
            "tlaloc_prefix_cache_hits_total", "Prompt tokens of STARTs whose KV was found cached",
            F.COUNTER).Metric(labels=self.labels)
        self.prefix_host_hits = family(
            "tlaloc_prefix_cache_host_hits_total", "Prompt tokens of STARTs whose KV was found "
            "on the host tier and written back (of the hits)", F.COUNTER).Metric(
            labels=self.labels)
        self.continuations = family(
            "tlaloc_turn_continuations_total", "STARTs that took over an ended sequence whole",
            F.COUNTER).Metric(labels=self.labels)
        self._evictions = family("tlaloc_kv_evictions_total", "Cached KV given up for new "
                                 "requests, by what (pages, sequences)", F.COUNTER)
        self.swapped_now = family("tlaloc_sequences_swapped", "Sequences whose KV is swapped "
                                  "out to host memory", F.GAUGE).Metric(labels=self.labels)
        self.host_bytes = family("tlaloc_host_kv_bytes", "Host memory holding swapped-out "
                                 "sequences' KV", F.GAUGE).Metric(labels=self.labels)
        self.host_cached_bytes = family("tlaloc_host_cached_kv_bytes", "Host memory holding "
                                        "full blocks evicted from the device (a second level "
                                        "of the prefix cache)", F.GAUGE).Metric(
            labels=self.labels)
        self.preemptions = family("tlaloc_preemptions_total", "Sequences with a request in "
                                  "flight swapped out to make room (their request waits)",
                                  F.COUNTER).Metric(labels=self.labels)
        self.recomputes = family("tlaloc_kv_recomputes_total", "Sequences whose KV was "
                                 "dropped to make room while the host tier was full (their "
                                 "next request computes it again)", F.COUNTER).Metric(
            labels=self.labels)
        self._held_back = family("tlaloc_held_for_compile_total", "Calls held back until an "
                                 "entry they need compiled (other sequences were served "
                                 "meanwhile), by kind (decode, prefill, verify)", F.COUNTER)
        self._nonfinite = family("tlaloc_nonfinite_logits_total", "Rows whose logits held NaN "
                                 "or infinity, answered with an error instead, by kind of call",
                                 F.COUNTER)
        self.drafted = family("tlaloc_draft_tokens_total", "Draft tokens checked by verify "
                              "calls (speculative decoding)", F.COUNTER).Metric(labels=self.labels)
        self.accepted = family("tlaloc_accepted_draft_tokens_total", "Draft tokens verify calls "
                               "accepted (the acceptance rate: this over "
                               "tlaloc_draft_tokens_total)", F.COUNTER).Metric(labels=self.labels)
        self.verify_steps = family("tlaloc_verify_steps_total", "Sequence steps that verified "
                                   "drafts (tokens a step: accepted drafts over this, plus one)",
                                   F.COUNTER).Metric(labels=self.labels)
        self._swap_bytes = family("tlaloc_swap_bytes_total", "KV bytes moved between the "
                                  "device and the host tier, by direction (out, in)", F.COUNTER)
        self._phases = family("tlaloc_call_phase_seconds_total", "Seconds spent in each phase "
                              "of the calls (batcher.CallTiming), by kind of call", F.COUNTER)
        self._by_label: dict = {}
        self._expert_tokens = family("tlaloc_expert_tokens_total", "A mixture of experts' "
                                     "tokens routed to each expert, by layer and expert "
                                     "(expert_load_metrics)", F.COUNTER)
        self._experts = None  # (the runtime's running load, what was reported, layer ids)
        self._adapters_held = family("tlaloc_lora_adapters", "LoRA adapters held, on the "
                                     "device (in a slot) and in host memory", F.GAUGE)
        self._adapter_moves = family("tlaloc_lora_adapter_moves_total", "LoRA adapters "
                                     "written into a slot (load), whose slot went to another "
                                     "(evict), dropped from host memory (host_evict)",
                                     F.COUNTER)
        self._adapter_sequences = family("tlaloc_lora_sequences_total", "Sequences started "
                                         "with each LoRA adapter", F.COUNTER)
        self._adapters = None  # (the registry, what was reported)
        if self.has_histograms:
            self._batch = family("tlaloc_batch_size", "Rows per execution", F.HISTOGRAM)
            self._exec = family("tlaloc_execution_seconds", "Execution time of a call",
                                F.HISTOGRAM)
            self.wait = family("tlaloc_backend_wait_seconds", "Time a request waits in the "
                               "backend before its execution starts", F.HISTOGRAM).Metric(
                labels=self.labels, buckets=self.WAIT_BUCKETS)
            self.prompt_wait = family("tlaloc_prompt_wait_seconds", "Time from a prompt's "
                                      "arrival to its first tokens' execution", F.HISTOGRAM
                                      ).Metric(labels=self.labels, buckets=self.WAIT_BUCKETS)
            self.swap_seconds = family("tlaloc_swap_seconds", "Time one swap out or in takes",
                                       F.HISTOGRAM).Metric(labels=self.labels,
                                                           buckets=self.EXEC_BUCKETS)
            self.send = family("tlaloc_response_send_seconds", "Time a response takes to hand "
                               "over to Triton (the python backend's IPC)", F.HISTOGRAM).Metric(
                labels=self.labels, buckets=self.WAIT_BUCKETS)
            self.queued = family("tlaloc_reply_queued_seconds", "Time a reply waits for a "
                                 "reply sender thread", F.HISTOGRAM).Metric(
                labels=self.labels, buckets=self.WAIT_BUCKETS)

    def entries(self, compiled: int, total: int) -> None:
        """Entries compiled so far (the rest compile in the background), of all."""
        self.writer.set(self.entries_compiled, compiled)
        self.writer.set(self.entries_total, total)

    def memory(self, weights: dict, kv_pools: dict, state_pools: dict) -> None:
        """Bytes by device id, of each kind."""
        for what, by_device in (("weights", weights), ("kv_pools", kv_pools),
                                ("state_pools", state_pools)):
            for device, n in by_device.items():
                self.writer.set(self._metric(self._memory, what=what, device=str(device)), n)

    def resident_memory(self, nbytes: int | None) -> None:
        if nbytes is not None:
            self.writer.set(self.resident, nbytes)

    def sent(self, seconds: float) -> None:
        if self.has_histograms:
            self.writer.observe(self.send, seconds)

    def reply_queued(self, seconds: float) -> None:
        if self.has_histograms:
            self.writer.observe(self.queued, seconds)

    def _metric(self, family, buckets=None, **labels):
        """The family's metric for these labels (with the model's), made on first use."""
        k = (id(family), tuple(sorted(labels.items())))
        if k not in self._by_label:
            kw = {"buckets": buckets} if buckets is not None else {}
            self._by_label[k] = family.Metric(labels={**self.labels, **labels}, **kw)
        return self._by_label[k]

    def watch_experts(self, load, layers: list[int]) -> None:
        """Report a runtime's expert load (its running count [sparse layers, experts], layer i
        of it the model's layers[i]) after each call."""
        self._experts = (load, load.copy(), list(layers))

    def _report_experts(self) -> None:
        load, reported, layers = self._experts
        for i, e in zip(*np.nonzero(load != reported)):
            self.writer.increment(self._metric(self._expert_tokens, layer=str(layers[i]),
                                               expert=str(e)), int(load[i, e] - reported[i, e]))
        reported[...] = load

    def watch_adapters(self, registry) -> None:
        """Report a LoRA adapter registry's counts (lora/registry.py) after each call."""
        self._adapters = (registry, {})
        self._report_adapters()

    def _report_adapters(self) -> None:
        registry, reported = self._adapters
        stats = registry.stats
        now = {("move", "load"): stats.loads, ("move", "evict"): stats.evictions,
               ("move", "host_evict"): stats.host_evictions,
               **{("adapter", name): n for name, n in stats.rows.items()}}
        for key, n in now.items():
            if n != reported.get(key, 0):
                family, label = ((self._adapter_moves, "move") if key[0] == "move" else
                                 (self._adapter_sequences, "adapter"))
                self.writer.increment(self._metric(family, **{label: key[1]}),
                                      n - reported.get(key, 0))
                reported[key] = n
        self.writer.set(self._metric(self._adapters_held, where="device"), registry.on_device)
        self.writer.set(self._metric(self._adapters_held, where="host"), len(registry.host))

    def call(self, kind, entry, rows, tokens, waits_s, seconds, executions=1):
        if self._experts is not None:
            self._report_experts()
        if self._adapters is not None:
            self._report_adapters()
        w = self.writer
        w.increment(self._metric(self._executions, kind=kind), executions)
        w.increment(self._metric(self._tokens, kind=kind), tokens)
        if self.has_histograms:
            w.observe(self._metric(self._batch, self.SIZE_BUCKETS, kind=kind), rows)
            w.observe(self._metric(self._exec, self.EXEC_BUCKETS, kind=kind), seconds)
            for wait in waits_s:
                w.observe(self.wait, wait)

    def refusal(self, reason):
        self.writer.increment(self._metric(self._refusals, reason=reason), 1)

    def step(self, prompt_tokens, decode_tokens):
        for part, n in (("prompt", prompt_tokens), ("decode", decode_tokens)):
            if n:
                self.writer.increment(self._metric(self._step_tokens, part=part), n)
        carried = ("mixed" if prompt_tokens and decode_tokens else
                   "prompt" if prompt_tokens else "decode")
        self.writer.increment(self._metric(self._steps, carried=carried), 1)

    def prompt_started(self, wait_s):
        if self.has_histograms:
            self.writer.observe(self.prompt_wait, wait_s)

    def timing(self, t):
        for phase in t.PHASES:
            self.writer.increment(self._metric(self._phases, kind=t.kind, phase=phase),
                                  getattr(t, phase))

    def reclaimed(self, sequences, pages):
        self.writer.increment(self.reclaimed_sequences, sequences)
        self.writer.increment(self.reclaimed_pages, pages)

    def prefix(self, queried, reused, continued, from_host=0):
        self.writer.increment(self.prefix_queries, queried)
        self.writer.increment(self.prefix_hits, reused)
        self.writer.increment(self.prefix_host_hits, from_host)
        if continued:
            self.writer.increment(self.continuations, 1)

    def evicted(self, pages, sequences):
        self.writer.increment(self._metric(self._evictions, what="pages"), pages)
        self.writer.increment(self._metric(self._evictions, what="sequences"), sequences)

    def state(self, pools, sequences):
        for pool, (used, cached, free) in pools.items():
            self.writer.set(self.pages_used[pool], used)
            self.writer.set(self.pages_cached[pool], cached)
            self.writer.set(self.pages_free[pool], free)
        self.writer.set(self.sequences, sequences)

    def swapped(self, direction, nbytes, seconds):
        self.writer.increment(self._metric(self._swap_bytes, direction=direction), nbytes)
        if self.has_histograms:
            self.writer.observe(self.swap_seconds, seconds)

    def preempted(self):
        self.writer.increment(self.preemptions, 1)

    def recomputed(self):
        self.writer.increment(self.recomputes, 1)

    def held_back(self, kind):
        self.writer.increment(self._metric(self._held_back, kind=kind), 1)

    def nonfinite(self, kind, rows):
        self.writer.increment(self._metric(self._nonfinite, kind=kind), rows)

    def speculation(self, drafted, accepted, steps):
        self.writer.increment(self.drafted, drafted)
        self.writer.increment(self.accepted, accepted)
        self.writer.increment(self.verify_steps, steps)

    def host(self, nbytes, sequences, cached_bytes=0):
        self.writer.set(self.host_bytes, nbytes)
        self.writer.set(self.host_cached_bytes, cached_bytes)
        self.writer.set(self.swapped_now, sequences)


class GrammarMetrics(GrammarObserver):
    """Structured output's metrics (generation/grammar.py reports to it), beside a
    model's own: its writer, labels and families list (the sequence model's for the local
    loop's grammars, the generate model's for the BLS loop's)."""

    MASK_BUCKETS = [1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.1]
    COMPILE_BUCKETS = [1e-4, 1e-3, 0.01, 0.1, 1.0, 10.0]

    def __init__(self, writer: MetricsWriter, families: list, labels: dict[str, str]):
        F = pb_utils.MetricFamily
        self.writer = writer

        def family(name, description, kind):
            families.append(F(name=name, description=description, kind=kind))
            return _Family(families[-1], name, writer)

        def by_kind(name, description):  # made here: the reports come from several threads
            f = family(name, description, F.COUNTER)
            return {k: f.Metric(labels={**labels, "kind": k}) for k in KINDS}

        self.constrained_total = by_kind("tlaloc_structured_generations_total", "Generations "
                                         "started under a structured_output constraint")
        self.compiles = by_kind("tlaloc_grammar_compiles_total", "Constraints compiled")
        self.cache_hits = by_kind("tlaloc_grammar_cache_hits_total", "Constraints found "
                                  "compiled")
        self.forced_total = family(
            "tlaloc_grammar_forced_tokens_total", "Tokens a grammar forced, emitted without the "
            "model choosing them (fast-forward: fed several in one verify call when that pays)",
            F.COUNTER).Metric(labels=labels)
        self.compile_seconds = self.mask_seconds = self.wait_seconds = None
        if hasattr(F, "HISTOGRAM"):
            self.compile_seconds = family(
                "tlaloc_grammar_compile_seconds", "Time a constraint takes to compile",
                F.HISTOGRAM).Metric(labels=labels, buckets=self.COMPILE_BUCKETS)
            self.mask_seconds = family(
                "tlaloc_grammar_mask_seconds", "Time a step's token mask takes to compute (on "
                "a worker thread, while the step's call runs)", F.HISTOGRAM).Metric(
                labels=labels, buckets=self.MASK_BUCKETS)
            self.wait_seconds = family(
                "tlaloc_grammar_mask_wait_seconds", "Time the thread choosing a token waited "
                "for its mask, still computing when the call ended (what the call did not "
                "hide)", F.HISTOGRAM).Metric(labels=labels, buckets=self.MASK_BUCKETS)

    def constrained(self, kind: str) -> None:
        self.writer.increment(self.constrained_total[kind], 1)

    def compiled(self, kind: str, seconds: float) -> None:
        self.writer.increment(self.compiles[kind], 1)
        if self.compile_seconds is not None:
            self.writer.observe(self.compile_seconds, seconds)

    def cache_hit(self, kind: str) -> None:
        self.writer.increment(self.cache_hits[kind], 1)

    def masked(self, seconds: float) -> None:
        if self.mask_seconds is not None:
            self.writer.observe(self.mask_seconds, seconds)

    def forced(self, tokens: int) -> None:
        self.writer.increment(self.forced_total, tokens)

    def waited(self, seconds: float) -> None:
        if self.wait_seconds is not None:
            self.writer.observe(self.wait_seconds, seconds)

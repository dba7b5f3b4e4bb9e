"""The generate model: text generation on the server, streamed (docs/design.md#front-ends).

A decoupled Triton Python model written by `tlaloc repository` beside the sequence model. Each
request (text_input or input_ids, sampling_parameters as JSON) is checked here, then generated
as a sequence of the sequence model, whose decode steps go through that model's batcher, so
concurrent generations decode in the same cohorts as every other sequence. Two loops:

- `generation_loop` "local" (the default): the loop runs in the sequence model's process
  (generation/local_generation.py), reached over a local link; each round's tokens come back in one
  message, and the responses are sent by a thread of their own (generation/local_streams.py),
  several tokens to a response when the sends fall behind.
- "bls" (and the fallback when the link cannot be opened): a thread per request calls the
  sequence model through BLS (pb_utils.InferenceRequest with a fresh correlation id and the
  START / END flags), once per token. Greedy steps ask for ARGMAX alone (4 bytes); sampled
  steps for LOGITS, sampled here (sampling.Sampler: temperature, top-k, top-p, a seed).

Speculation (the `speculative` sampling parameter: drafts found by prompt lookup, or decoded by
the draft model this model's `draft_model` parameter names, verified in one call) runs in the
local loop, where each step's drafts and the rule that keeps them are on the batching thread
(generation/local_generation.py, generation/speculative.py, generation/draft_model.py). The BLS loop
decodes a token a step whatever `speculative` says: the same ids, or the same distribution when
sampling, only slower.

Each step's new text goes out as a response (text_output, token_ids); the last response, flagged
final, carries finish_reason (stop, length, cancelled), prompt_tokens and completion_tokens. With
stream false, one response holds the whole text. A cancelled request (the client closed its
stream or cancelled the call) ends its sequence at once, which frees its pages. Every error
path sends exactly one final response.
"""

from __future__ import annotations

import functools
import json
import logging
import queue
import threading
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from .backend import error_response, model_settings, setup_logging
from .parent_watch import watch_parent
from ..codes import (CANCELLED, INTERNAL, INVALID_ARG, UNAVAILABLE, coded_message,
                     split_coded_message)
from .metrics import MetricsWriter
from .model_metrics import GrammarMetrics
from ..frontends.client import new_sequence_id
from ..generation.local_streams import InstanceLoops, LocalStream, Outbound, StreamSenders
from ..generation.logprobs import logprob_entry
from ..generation.penalties import check_token_ids
from ..generation.sampling import Sampler, SamplingError, SamplingParams, TextStream
from ..generation.grammar import Grammars, GrammarsBusy
from ..generation.token_constraint import TokenConstraint

log = logging.getLogger("triton_tlaloc.generate")


PROMPT_CHARACTERS_PER_TOKEN = 32
# Room for every stop string and stop token id the sampling parameters may name.
MAX_SAMPLING_PARAMETERS_CHARS = 256 * 1024


class _GenerateError(Exception):
    def __init__(self, message: str, code: str):  # code: a codes.py name
        super().__init__(message)
        self.code = code


def _string_input(request, name: str) -> str | None:
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return None
    v = t.as_numpy().reshape(-1)[0]
    return v.decode() if isinstance(v, bytes) else str(v)


class TritonPythonModel:
    def initialize(self, args):
        params = model_settings(args, {"eos_token_ids": "", "tokenizer_dir": "",
                                       "max_prompt_characters": "",
                                       "generation_loop": "local", "draft_model": ""}).params
        setup_logging(args["model_name"])
        watch_parent()  # this process ends with its tritonserver
        self.model_name = args["model_name"]
        self.sequence_model = params["sequence_model"]
        # The sequence model that drafts for speculative.method draft_model ("": none)
        self.draft_model = params.get("draft_model", "")
        self.eos_ids = {int(t) for t in params.get("eos_token_ids", "").split(",") if t}
        self.max_context = int(params["max_context"])
        # A text prompt longer than this is refused before it is tokenized (a token is rarely
        # more than a few characters: the default leaves a wide margin over the context).
        self.max_prompt_chars = int(params.get("max_prompt_characters") or
                                    PROMPT_CHARACTERS_PER_TOKEN * self.max_context)
        self.tokenizer = None
        if params.get("tokenizer_dir") and (Path(params["tokenizer_dir"]) /
                                            "tokenizer.json").is_file():
            from ..frontends.tokenizer import ArtifactTokenizer

            self.tokenizer = ArtifactTokenizer(Path(params["tokenizer_dir"]))
            if self.tokenizer.eos_token_id is not None:
                self.eos_ids.add(self.tokenizer.eos_token_id)
        self.threads: set[threading.Thread] = set()
        self.lock = threading.Lock()
        self.send_lock = threading.Lock()
        self._metrics()
        # Structured output in the BLS loop (the local loop's grammars are the sequence
        # model's), reporting to this model's metrics
        self.grammars = None
        if self.tokenizer is not None:
            self.vocab = self.tokenizer.tok.get_vocab_size(with_added_tokens=True)
            self.grammars = Grammars(Path(params["tokenizer_dir"]), self.vocab,
                                     sorted(self.eos_ids), observer=GrammarMetrics(
                                         self.writer, self.families, {"model": self.model_name}))
        loop = params["generation_loop"]
        if loop not in ("local", "bls"):
            raise ValueError(f"generation_loop {loop!r}: expected local or bls")
        self.local = None
        if loop == "local":
            self.senders = StreamSenders(1, self._send_out, self._is_cancelled,
                                         lambda s: self.local.cancel(s))
            self.local = InstanceLoops(self.sequence_model, self.senders, self._observe_token,
                                       self._finished, draft_model=self.draft_model)
            self.intake: queue.SimpleQueue = queue.SimpleQueue()
            threading.Thread(target=self._take_in, name="tlaloc-generate-intake",
                             daemon=True).start()
        log.info("generate model %s: sequence model %s, generation loop %s, tokenizer %s, "
                 "end-of-sequence ids %s, draft model %s", self.model_name, self.sequence_model,
                 loop, "yes" if self.tokenizer else "none (input_ids only)",
                 sorted(self.eos_ids), self.draft_model or "none")

    def _metrics(self):
        """Updates are taken as plain Python by the generation threads and applied by the
        writer's one thread (each is an IPC round trip to Triton: not from every thread)."""
        F = pb_utils.MetricFamily
        labels = {"model": self.model_name}
        self.writer = MetricsWriter()
        self.families = [
            F(name="tlaloc_time_to_first_token_seconds", description="Request arrival to its "
              "first generated token", kind=F.HISTOGRAM),
            F(name="tlaloc_time_per_output_token_seconds", description="Time between a "
              "generation's tokens after the first", kind=F.HISTOGRAM),
            F(name="tlaloc_generations_total", description="Generations ended, by finish "
              "reason", kind=F.COUNTER)]
        buckets = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
        self.ttft = self.families[0].Metric(labels=labels, buckets=buckets)
        self.tpot = self.families[1].Metric(labels=labels, buckets=buckets)
        self.finished = {r: self.families[2].Metric(labels={**labels, "reason": r})
                         for r in ("stop", "length", "cancelled", "error")}

    def execute(self, requests):
        arrived = time.perf_counter()
        if self.local is not None:
            self.intake.put((requests, arrived))
            return None
        for request in requests:
            self._start_bls(request, arrived)
        return None

    def _start_bls(self, request, arrived: float, sender=None) -> None:
        thread = threading.Thread(target=self._run, args=(request, arrived, sender),
                                  name="tlaloc-generate", daemon=True)
        with self.lock:
            self.threads.add(thread)
        thread.start()

    def _send(self, sender, response, flags=0):
        """Responses are sent one at a time, whichever generation's thread sends: sends from
        several threads at once crashed the Python backend (boost::interprocess::
        lock_exception in libtriton_python.so; docs/performance.md)."""
        with self.send_lock:
            sender.send(response, flags=flags)

    def _cancelled(self, sender) -> bool:
        """is_cancelled is an IPC call on the response sender too: under the same lock as the
        sends (a fresh-clone CI run crashed the stub once with two generations, one of them
        being cancelled, while only the sends were serialized)."""
        with self.send_lock:
            return sender.is_cancelled()

    def _send_error(self, sender, message: str, code):
        """The final response of a request that failed or was cancelled; its message names
        its code (codes.coded_message: the gRPC stream drops the code itself)."""
        self._send(sender, error_response(coded_message(message, code), code),
                   flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self):
        if self.grammars is not None:
            self.grammars.close()
        if self.local is not None:
            self.intake.put(None)
            self.local.close()
            self.senders.stop()
        with self.lock:
            threads = list(self.threads)
        for t in threads:
            t.join(10)
        self.writer.close()

    # ---------------------------------------------------------------- local loop

    def _take_in(self):
        """The intake thread: checks each request, then starts the checked ones in the
        sequence model's process together (one message); a bad one gets its one error."""
        while True:
            item = self.intake.get()
            if item is None:
                return
            requests, arrived = item
            streams = []
            for request in requests:
                sender = request.get_response_sender()
                try:
                    prompt, params, stream = self._inputs(request)
                except _GenerateError as e:
                    self.writer.increment(self.finished["error"], 1)
                    self._send_error(sender, str(e), e.code)
                    continue
                if not self.local.connected():  # no link (yet): this one through BLS
                    self._start_bls(request, arrived, sender)
                    continue
                streams.append(LocalStream(sender, prompt, params, stream,
                                           self._text_stream(params), self._stops(params),
                                           arrived))
            if streams:
                self.local.start(streams)

    def _send_out(self, stream: LocalStream, out: Outbound) -> None:
        """One response of a local generation (on the stream sender thread)."""
        if out.error is not None:
            code, message = out.error
            response = error_response(coded_message(message, code), code)
        else:
            ended = out.finish is not None
            response = self._response(out.text, out.token_ids, out.finish,
                                      len(stream.prompt) if ended else None,
                                      stream.generated if ended else None, out.logprobs,
                                      out.prompt_logprobs)
        self._send(stream.sender, response,
                   flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if out.final else 0)

    def _is_cancelled(self, stream: LocalStream) -> bool:
        return self._cancelled(stream.sender)

    def _observe_token(self, stream: LocalStream, now: float) -> None:
        if stream.last_token is None:
            self.writer.observe(self.ttft, now - stream.arrived)
        else:
            self.writer.observe(self.tpot, now - stream.last_token)
        stream.last_token = now

    def _finished(self, stream: LocalStream) -> None:
        reason = stream.finish or ("cancelled" if stream.error[0] == CANCELLED else "error")
        self.writer.increment(self.finished[reason], 1)

    # ---------------------------------------------------------------- one generation (BLS)

    def _run(self, request, arrived: float, sender=None):
        sender = sender or request.get_response_sender()
        try:
            self._generate(request, sender, arrived)
        except _GenerateError as e:
            self.writer.increment(self.finished["error"], 1)
            self._send_error(sender, str(e), e.code)
        except SamplingError as e:  # the request's own (its grammar past a limit at a step)
            self.writer.increment(self.finished["error"], 1)
            self._send_error(sender, str(e), INVALID_ARG)
        except Exception as e:  # never leave a request unanswered
            log.exception("generation failed")
            self.writer.increment(self.finished["error"], 1)
            self._send_error(sender, f"generation failed: {type(e).__name__}: {e}",
                             INTERNAL)
        finally:
            with self.lock:
                self.threads.discard(threading.current_thread())

    def _inputs(self, request) -> tuple[list[int], SamplingParams, bool]:
        bad = INVALID_ARG
        sampling = _string_input(request, "sampling_parameters") or "{}"
        if len(sampling) > MAX_SAMPLING_PARAMETERS_CHARS:
            raise _GenerateError(f"sampling_parameters: {len(sampling)} characters, more than "
                                 f"{MAX_SAMPLING_PARAMETERS_CHARS}", bad)
        try:
            params = SamplingParams.from_dict(json.loads(sampling))
            if self.tokenizer is not None:  # the sequence model checks it too
                check_token_ids(params, self.vocab)
        except (SamplingError, json.JSONDecodeError, TypeError, ValueError) as e:
            raise _GenerateError(f"sampling_parameters: {e}", bad) from None
        if (params.speculative is not None and params.speculative.method == "draft_model"
                and not self.draft_model):
            raise _GenerateError(f"sampling_parameters: speculative.method draft_model: "
                                 f"{self.model_name} names no draft model (tlaloc repository "
                                 f"--draft-model)", bad)
        ids_t = pb_utils.get_input_tensor_by_name(request, "input_ids")
        text = _string_input(request, "text_input")
        # Sizes first, then the work: no id list converted, no text tokenized, that must fail.
        if ids_t is not None:
            ids = ids_t.as_numpy().reshape(-1)
            self._check_length("input_ids", ids.size)
            prompt = ids.tolist()
        elif text is not None:
            if self.tokenizer is None:
                raise _GenerateError("text_input needs the artifact's tokenizer, which this "
                                     "model has not got: send input_ids", bad)
            if len(text) > self.max_prompt_chars:
                raise _GenerateError(f"text_input holds {len(text)} characters: more than "
                                     f"max_prompt_characters, {self.max_prompt_chars}", bad)
            prompt = self.tokenizer.encode(text)
            self._check_length("the tokenized text_input", len(prompt))
        else:
            raise _GenerateError("send text_input or input_ids", bad)
        if not prompt:
            raise _GenerateError("the prompt is empty", bad)
        if params.stop and self.tokenizer is None:
            raise _GenerateError("stop strings need the artifact's tokenizer", bad)
        stream_t = pb_utils.get_input_tensor_by_name(request, "stream")
        stream = True if stream_t is None else bool(stream_t.as_numpy().reshape(-1)[0])
        return prompt, params, stream

    def _text_stream(self, params: SamplingParams) -> TextStream:
        if self.tokenizer is None:
            return TextStream(lambda ids: "", params.stop)
        return TextStream(functools.partial(self.tokenizer.decode,
                                            skip_special_tokens=params.skip_special_tokens),
                          params.stop)

    def _stops(self, params: SamplingParams) -> set[int]:
        """The ids that end a generation (not part of its text)."""
        return set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_ids)

    def _check_length(self, what: str, n: int) -> None:
        if n > self.max_context:
            raise _GenerateError(f"{what}: {n} tokens, more than the largest context "
                                 f"({self.max_context})", INVALID_ARG)

    def _step(self, seq_id, tokens, *, start=False, end=False, outputs=("ARGMAX",),
              cache_salt=None, lora=None):
        """One request to the sequence model (BLS); returns its outputs by name."""
        flags = ((pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START if start else 0)
                 | (pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END if end else 0))
        parameters = {**({"cache_salt": cache_salt} if cache_salt is not None else {}),
                      **({"lora": lora} if lora is not None else {})}
        kw = {"parameters": parameters} if parameters else {}
        req = pb_utils.InferenceRequest(
            model_name=self.sequence_model,
            inputs=[pb_utils.Tensor("TOKENS", np.asarray(tokens, np.int32).reshape(1, -1))],
            requested_output_names=list(outputs), correlation_id=seq_id, flags=flags, **kw)
        resp = req.exec()
        if resp.has_error():  # its code is in the message: BLS drops the error's own
            code, message = split_coded_message(resp.error().message())
            raise _GenerateError(message, code or INTERNAL)
        return {t.name(): t.as_numpy().reshape(-1) for t in resp.output_tensors()}

    def _constraint(self, params: SamplingParams, stops: set[int]) -> TokenConstraint | None:
        """The generation's grammar (compiled before its START takes a page), or None."""
        if params.structured_output is None:
            return None
        if self.grammars is None:
            raise _GenerateError("sampling_parameters: structured_output needs the artifact's "
                                 "tokenizer, which this model has not got", INVALID_ARG)
        try:  # compiled on the grammars' threads, within their limits; this one waits
            return self.grammars.constraint(params.structured_output, stops)
        except SamplingError as e:
            raise _GenerateError(f"sampling_parameters: {e}", INVALID_ARG) from None
        except GrammarsBusy as e:
            raise _GenerateError(f"sampling_parameters: {e}", UNAVAILABLE) from None

    def _generate(self, request, sender, arrived: float):
        prompt, params, stream = self._inputs(request)
        if params.prompt_logprobs is not None:
            # Feeding the prompt a few tokens a call is the local loop's (PromptScoring)
            raise _GenerateError("sampling_parameters: prompt_logprobs: computed by the local "
                                 "loop only, and this generation runs over BLS (the local "
                                 "link is not up, or generation_loop is bls)", INVALID_ARG)
        text = self._text_stream(params)
        stops = self._stops(params)
        sampler = Sampler(params, prompt, stops)
        constraint = self._constraint(params, stops)
        # The device's argmax serves a greedy choice unless the logits are changed first
        outputs = (("ARGMAX",) if params.greedy and constraint is None
                   and sampler.adjuster is None and params.logprobs is None else ("LOGITS",))
        logprobs = [] if params.logprobs is not None else None
        seq_id = new_sequence_id()
        generated, pieces, reason = [], [], "length"
        try:
            # Inside the try: a refused START is ENDed too, or its Triton sequence slot would
            # stay taken until the idle timeout.
            out = self._step(seq_id, prompt, start=True, outputs=outputs,
                             cache_salt=params.cache_salt, lora=params.lora)
            last = None
            while True:
                if constraint is not None and constraint.queued:
                    token = constraint.queued[0]  # forced: whatever the logits say
                elif constraint is not None:
                    logits = constraint.masked(out["LOGITS"])  # None: complete, no end token
                    token = None if logits is None else sampler.choose(logits)
                else:
                    token = (int(out["ARGMAX"][0]) if outputs == ("ARGMAX",)
                             else sampler.choose(out["LOGITS"]))
                sampler.took([] if token is None else [token])
                now = time.perf_counter()
                if last is None:
                    self.writer.observe(self.ttft, now - arrived)
                else:
                    self.writer.observe(self.tpot, now - last)
                last = now
                if token is None or token in stops:  # not text; what was held back goes out
                    reason, tail = "stop", text.flush()
                    if tail:
                        pieces.append(tail)
                        if stream:
                            self._send(sender, self._response(tail, []))
                    break
                generated.append(token)
                entry = None
                if logprobs is not None:
                    entry = [logprob_entry(out["LOGITS"], token, params.logprobs)]
                    logprobs += entry
                piece = text.push(token)
                if text.stopped:
                    reason = "stop"
                elif (len(generated) >= params.max_tokens
                      or len(prompt) + len(generated) >= self.max_context):
                    piece += text.flush()
                if stream:  # every step: its token, and the text it completes (maybe none)
                    self._send(sender, self._response(piece, [token], logprobs=entry))
                pieces.append(piece)
                if text.stopped or len(generated) >= params.max_tokens:
                    break
                if len(prompt) + len(generated) >= self.max_context:
                    break  # "length": the next token would pass the largest context
                if self._cancelled(sender):
                    reason = "cancelled"
                    break
                if constraint is not None:
                    constraint.took([token])
                out = self._step(seq_id, [token], outputs=outputs)
        finally:  # END frees the sequence's pages and Triton's slot at once (also after an error)
            try:
                self._step(seq_id, [], end=True, outputs=())
            except _GenerateError:
                log.warning("sequence %s: END was refused", seq_id)
        self.writer.increment(self.finished[reason], 1)
        if reason == "cancelled":
            self._send_error(sender, "the request was cancelled", CANCELLED)
            return
        final = self._response("" if stream else "".join(pieces),
                               [] if stream else generated, reason, len(prompt), len(generated),
                               None if stream or logprobs is None else logprobs)
        self._send(sender, final, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    @staticmethod
    def _response(text: str, token_ids: list[int], finish_reason: str | None = None,
                  prompt_tokens: int | None = None, completion_tokens: int | None = None,
                  logprobs: list | None = None, prompt_logprobs: list | None = None):
        outputs = [pb_utils.Tensor("text_output", np.array([text.encode()], dtype=np.object_)),
                   pb_utils.Tensor("token_ids", np.asarray(token_ids, np.int32))]
        for name, entries in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
            if entries is not None:  # one entry a token id (logprobs.logprob_entry)
                outputs.append(pb_utils.Tensor(name, np.array(
                    [json.dumps(entries).encode()], dtype=np.object_)))
        if finish_reason is not None:
            outputs += [
                pb_utils.Tensor("finish_reason", np.array([finish_reason.encode()], np.object_)),
                pb_utils.Tensor("prompt_tokens", np.array([prompt_tokens], np.int32)),
                pb_utils.Tensor("completion_tokens", np.array([completion_tokens], np.int32))]
        return pb_utils.InferenceResponse(output_tensors=outputs)

"""Generation loops run in the sequence model's process (generation/local_generation.py), the
generate model's side of them (generation/local_streams.py) and the link between
(generation/generation_link.py), without Triton: a real batcher over the simulated runtime, a real
Unix socket."""

from __future__ import annotations

import multiprocessing.connection
import os
import threading
import time

import numpy as np
import pytest
from checks.fakes import fake_artifact
from checks.schemas import byte_level_bpe

from triton_tlaloc.scheduling.admission import Reply
from triton_tlaloc.batcher import Batcher
from triton_tlaloc.engine.core import Engine
from triton_tlaloc.generation.local_streams import (LocalLoop, LocalStream, Outbound, StreamSenders)
from triton_tlaloc.generation.sampling import SamplingParams, TextStream
from triton_tlaloc.generation.generation_link import LinkError, connect, link_paths, listen
from triton_tlaloc.generation.speculative import SpeculativeParams
from triton_tlaloc.generation.grammar import Grammars
from triton_tlaloc.generation.link_server import LocalGenerations
from triton_tlaloc.generation.local_generation import Generation, Speculation
from triton_tlaloc.scheduling.policy import BatchPolicy
from triton_tlaloc.runtime.simulated import SimulatedRuntime

ART = fake_artifact(batch_ladder=(1, 4, 16), context_ladder=(64,), block_size=8,
                    num_blocks=400)
SERVER_PID = 4_000_000_000  # no real process has it: the link's files are the test's own


def logits_at(token: int, vocab: int = 16) -> Reply:
    row = np.zeros(vocab, np.float32)
    row[token] = 1.0
    return Reply(logits=row)


def test_a_generation_chooses_emits_queues_its_next_step_and_ends_once():
    events, queued = [], []
    gen = Generation(7, [1, 2], SamplingParams(max_tokens=3), {9}, 64, events.append,
                     queued.extend)
    first = gen.start_request()
    assert first.start and first.tokens == [1, 2] and first.seq_id is gen.seq_id
    gen.on_reply(logits_at(5))
    gen.on_reply(logits_at(6))
    assert events == [[7, 5, None], [7, 6, None]]
    assert [r.tokens for r in queued] == [[5], [6]] and not any(r.end for r in queued)
    gen.on_reply(logits_at(4))  # the third token: max_tokens reached
    assert events[-1] == [7, 4, "length"] and queued[-1].end and queued[-1].tokens == []
    before = (len(events), len(queued))
    gen.on_reply(logits_at(4))  # a reply after the end: nothing more is emitted or queued
    assert (len(events), len(queued)) == before

    for reply, want in ((logits_at(9), [8, -1, "stop"]),  # a stop id is not emitted
                        (Reply(error="KV pool full", code="UNAVAILABLE"),
                         [8, -1, "error", "UNAVAILABLE", "KV pool full"])):
        events.clear()
        queued.clear()
        gen = Generation(8, [1], SamplingParams(max_tokens=5), {9}, 64, events.append,
                         queued.extend)
        gen.on_reply(reply)
        assert events == [want] and [r.end for r in queued] == [True]
    events.clear()
    gen = Generation(9, [1], SamplingParams(max_tokens=5), set(), 64, events.append,
                     queued.extend)
    gen.cancelled = True
    gen.on_reply(logits_at(3))
    assert events == [[9, -1, "cancelled"]]
    # The largest context ends a generation too: a prompt of 62 in a context of 64.
    events.clear()
    gen = Generation(10, list(range(62)), SamplingParams(max_tokens=50), set(), 64,
                     events.append, queued.extend)
    gen.on_reply(logits_at(3))
    gen.on_reply(logits_at(3))
    assert [e[2] for e in events] == [None, "length"]


def test_a_failure_while_choosing_ends_the_generation_with_one_error_and_its_end():
    """NaN logits under top-k / top-p sampling used to raise in the sampler on the batching
    thread: the reply was lost, the client waited forever and the sequence stayed held."""
    events, queued = [], []
    gen = Generation(3, [1, 2], SamplingParams(max_tokens=5, temperature=0.8, top_k=4,
                                                top_p=0.9, seed=1),
                     set(), 64, events.append, queued.extend)
    gen.on_reply(Reply(logits=np.full(16, np.nan, np.float32)))
    assert len(events) == 1 and events[0][:4] == [3, -1, "error", "INTERNAL"]
    assert "generation 3" in events[0][4]
    assert [r.end for r in queued] == [True] and gen.finished
    gen.on_reply(logits_at(4))  # nothing after the end
    assert len(events) == 1 and len(queued) == 1


def test_nonfinite_logits_are_answered_with_an_error_and_counted():
    """A call whose row's logits hold NaN or infinity: that row's request gets an error naming
    it (not logits a sampler would turn into a token), the other rows their logits."""
    from checks.fakes import Harness

    h = Harness(fake_artifact())
    real_run = h.rt.run

    def run(entry_name, step):
        out = real_run(entry_name, step).astype(np.float32)
        for r, row in enumerate(step["TOKEN_IDS"]):
            if 66 in row:  # the poisoned prompt's row
                out[r, 3] = np.nan
        return out
    h.rt.run = run
    h.send("A", [66, 5, 6], start=True)
    h.send("B", [10, 11, 12], start=True)
    h.clock.advance(1.0)
    h.run()
    assert h.last("A").code == "INTERNAL" and "NaN or infinity" in h.last("A").error
    assert h.last("B").error is None and np.isfinite(h.last("B").logits).all()
    assert h.batcher.stats.nonfinite_rows["prefill"] == 1


def test_local_sequence_ids_equal_no_client_id():
    gen = Generation(1, [1], SamplingParams(), set(), 64, print, print)
    number = gen.seq_id.number
    assert gen.seq_id != number and gen.seq_id != str(gen.seq_id) and gen.seq_id != f"{number}"
    assert {gen.seq_id: 1}.get(number) is None


class Sent:
    """The generate model's sends, captured: each stream's responses in order."""

    def __init__(self, delay_s: float = 0.0):
        self.delay_s = delay_s
        self.by_stream: dict[int, list[Outbound]] = {}
        self.done = threading.Condition()

    def __call__(self, stream: LocalStream, out: Outbound) -> None:
        time.sleep(self.delay_s)
        with self.done:
            self.by_stream.setdefault(id(stream), []).append(out)
            self.done.notify_all()

    def wait_finals(self, n: int, timeout: float = 30.0) -> None:
        with self.done:
            assert self.done.wait_for(lambda: sum(
                1 for outs in self.by_stream.values() if outs[-1].final) >= n, timeout)


def streams_for(prompts, max_tokens, streaming=True):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return [LocalStream(None, p, params, streaming, TextStream(lambda ids: "", ()), set(),
                        time.perf_counter()) for p in prompts]


def greedy_alone(prompt: list[int], n: int) -> list[int]:
    engine = Engine(SimulatedRuntime(ART, 0.0))
    return engine.generate_greedy(prompt, n).generated_ids


class Served:
    """A batcher over the simulated runtime with local generations, and a generate model's
    loop linked to it through a real socket; `run` generates and shuts everything down."""

    def __init__(self, step_s: float, send_delay_s: float = 0.0, cancelled: bool = False,
                 grammars=None):
        self.rt = SimulatedRuntime(ART, step_s)
        self.batcher = Batcher(Engine(self.rt), BatchPolicy(prefill_wait_s=0.001))
        self.local = LocalGenerations("tiny", self.batcher.submit_group, ART.max_context,
                                      SERVER_PID, Speculation.of(self.batcher.engine),
                                      grammars=grammars)
        self.batcher.round_listeners.append(self.local.round_ended)
        self.batcher.start()
        self.sent = Sent(send_delay_s)
        self.cancels = []
        self.senders = StreamSenders(1, self.sent, lambda s: cancelled, self._cancel)
        self.loop = LocalLoop("tiny", self.senders, lambda s, now: None, lambda s: None,
                              SERVER_PID)
        assert self.loop.connected()

    def wait_released(self) -> bool:
        """Whether every sequence was released within 5 s (a generation's END follows its
        last event)."""
        for _ in range(500):
            if not self.batcher.sequences:
                return True
            time.sleep(0.01)
        return False

    def _cancel(self, stream):
        self.cancels.append(stream)
        self.loop.cancel(stream)

    def run(self, streams: list[LocalStream]) -> list[list[Outbound]]:
        try:
            self.loop.start(streams)
            self.sent.wait_finals(len(streams))
            self.released = self.wait_released()
        finally:
            self.loop.close()
            self.senders.stop()
            self.batcher.stop()
            self.local.stop()
        return [self.sent.by_stream[id(s)] for s in streams]


def test_16_local_generations_get_the_ids_they_get_alone_in_shared_calls(private_tmp):
    """Through a real socket and a real batcher: 16 streams started together decode in shared
    calls, each equal to its greedy run alone; every stream ends with one final response
    (length, after all 12 tokens). Control: the streams' ids are told apart."""
    served = Served(0.002)
    prompts = [[(i * 7 + j) % 250 + 3 for j in range(4)] for i in range(16)]
    streams = streams_for(prompts, 12)
    got = []
    for s, outs in zip(streams, served.run(streams)):
        assert [o.final for o in outs] == [False] * (len(outs) - 1) + [True]
        assert outs[-1].finish == "length" and s.generated == 12
        got.append([t for o in outs for t in o.token_ids])
    assert got[:4] == [greedy_alone(p, 12) for p in prompts[:4]]
    assert len({tuple(ids) for ids in got}) > 8
    assert served.rt.runs <= 2 * 13  # at most two calls a step: the streams share them
    assert served.released  # every generation's sequence ENDed
    assert not served.local.socket_path.exists() and not served.local.key_path.exists()


def test_speculating_streams_get_their_greedy_ids_beside_plain_ones(private_tmp):
    """Streams that verify prompt-lookup drafts and a plain stream in the same rounds, through
    the socket and a real batcher: each gets its greedy ids alone. The simulated model's next
    token depends on the position, so lookups (found in the prompt's repeats) are wrong:
    verify calls ran, and what they kept is exactly the model's own."""
    served = Served(0.002)
    prompts = [[5, 6, 7, 5, 6, 7], [9, 10, 11, 12] * 3, [1, 2, 3]]
    params = [SamplingParams(max_tokens=16, ignore_eos=True, speculative=SpeculativeParams(
        num_draft_tokens=k)) for k in (4, 8)] + [SamplingParams(max_tokens=16, ignore_eos=True)]
    streams = [LocalStream(None, p, sp, True, TextStream(lambda ids: "", ()), set(),
                           time.perf_counter()) for p, sp in zip(prompts, params)]
    outs = served.run(streams)
    for prompt, stream_outs in zip(prompts, outs):
        assert [t for o in stream_outs for t in o.token_ids] == greedy_alone(prompt, 16)
        assert stream_outs[-1].finish == "length"
    assert served.released
    stats = served.batcher.stats
    assert stats.calls.get("verify", 0) > 0 and stats.drafted > 0


def test_responses_carry_several_tokens_when_sends_fall_behind(private_tmp):
    """Sends slower than the step: responses gather the tokens that came meanwhile, in order,
    nothing lost. Control: with sends far faster than the step, one response a token (a busy
    machine may hold one send past a step now and then: at most two responses gather)."""
    for send_delay, step, many in ((0.012, 0.001, True), (0.0, 0.04, False)):
        prompt = [5, 6, 7]
        outs, = Served(step, send_delay).run(streams_for([prompt], 16))
        assert [t for o in outs for t in o.token_ids] == greedy_alone(prompt, 16)
        gathered = sum(len(o.token_ids) > 1 for o in outs)
        if many:
            assert gathered and len(outs) <= 10, [len(o.token_ids) for o in outs]
        else:
            assert gathered <= 2, [len(o.token_ids) for o in outs]


def test_a_cancelled_stream_ends_with_one_cancelled_response_and_frees_its_sequence(
        private_tmp):
    served = Served(0.01, cancelled=True)
    streams = streams_for([[1, 2, 3]], 1000, streaming=False)
    outs, = served.run(streams)
    assert {id(s) for s in served.cancels} == {id(streams[0])}
    assert len(outs) == 1 and outs[0].error[0] == "CANCELLED"
    assert streams[0].generated < 1000 and served.released


def test_a_generate_model_unloading_ends_its_streams_and_the_sequences_are_freed(private_tmp):
    """Streams still generating when the generate model unloads get one final error each;
    the sequence model sees the link close and ends their sequences at their next step."""
    served = Served(0.01)
    streams = streams_for([[1, 2, 3], [4, 5]], 1000)
    served.loop.start(streams)
    time.sleep(0.1)
    served.loop.close()
    served.sent.wait_finals(2)
    freed = served.wait_released()
    served.senders.stop()
    served.batcher.stop()
    served.local.stop()
    for s in streams:
        outs = served.sent.by_stream[id(s)]
        assert [o.final for o in outs].count(True) == 1 and outs[-1].final
        assert outs[-1].error == ("UNAVAILABLE", "the generate model is unloading")
        assert 0 < s.generated < 1000
    assert freed


def test_the_link_refuses_a_peer_without_its_key_and_a_shared_directory(private_tmp):
    listener, sock, key_file = listen("tiny", SERVER_PID)
    try:
        assert oct(key_file.stat().st_mode & 0o777) == "0o600"
        accepted = []

        def accept():
            try:
                accepted.append(listener.accept())
            except multiprocessing.AuthenticationError as e:
                accepted.append(e)
        t = threading.Thread(target=accept)
        t.start()
        with pytest.raises(multiprocessing.AuthenticationError):
            multiprocessing.connection.Client(str(sock), family="AF_UNIX", authkey=b"x" * 32)
        t.join(5)
        assert isinstance(accepted[0], multiprocessing.AuthenticationError)
        with pytest.raises(LinkError, match="another instance"):
            listen("tiny", SERVER_PID)
    finally:
        listener.close()
    # A socket file nothing listens on (a killed server's): taken over.
    sock.unlink(missing_ok=True)
    import socket
    with socket.socket(socket.AF_UNIX) as stale:
        stale.bind(str(sock))
    assert sock.exists()
    listener, _, _ = listen("tiny", SERVER_PID)
    listener.close()
    with pytest.raises(LinkError, match="no local generation link"):
        connect("other", SERVER_PID)
    directory = link_paths("tiny", SERVER_PID)[0].parent
    os.chmod(directory, 0o755)
    with pytest.raises(LinkError, match="not a directory private to this user"):
        link_paths("tiny", SERVER_PID)


# ------------------------------------------------------------------ constraints compiling

class HeldGrammars(Grammars):
    """A grammar engine whose compiles wait for `release`; `inline`: the thread asking (the
    link's reader) waits as long first, as when it compiled there (the known-wrong
    variant)."""

    def __init__(self, directory, inline: bool = False):
        super().__init__(directory, 360, [0])
        self.release, self.inline = threading.Event(), inline
        self.compiling = threading.Event()

    def prepare(self, spec, stops, done):
        if self.inline:
            self.compiling.set()
            self.release.wait(10)
        return super().prepare(spec, stops, done)

    def _compile(self, spec):
        self.compiling.set()
        self.release.wait(10)
        return super()._compile(spec)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bpe")
    (directory / "tokenizer.json").write_text(byte_level_bpe(354, ["<eos>"]).to_str())
    return directory


def final_of(sent: Sent, stream: LocalStream, timeout: float) -> Outbound | None:
    """`stream`'s final response, once it came within `timeout` (None if it did not)."""
    with sent.done:
        sent.done.wait_for(lambda: any(o.final for o in sent.by_stream.get(id(stream), ())),
                           timeout)
        outs = sent.by_stream.get(id(stream), [])
    return outs[-1] if outs and outs[-1].final else None


@pytest.mark.parametrize("inline", [False, True], ids=["compile threads", "control: in line"])
def test_a_plain_generation_runs_while_a_constraint_compiles(private_tmp, tokenizer_dir,
                                                             inline):
    """Through the socket and a real batcher: a constrained stream whose compile is held,
    then a plain one in the same frame. The plain one generates all its tokens while the
    compile is held, and the constrained one starts (its START sent) once it is released.
    Control: compiled on the link's reader thread, as before, the plain one gets nothing
    while the compile is held."""
    grammars = HeldGrammars(tokenizer_dir, inline=inline)
    served = Served(0.002, grammars=grammars)
    constrained = LocalStream(None, [5, 6], SamplingParams.from_dict(
        {"max_tokens": 8, "structured_output": {"regex": "ok"}}), True,
        TextStream(lambda ids: "", ()), {0}, time.perf_counter())
    plain, = streams_for([[7, 8, 9]], 12)
    try:
        served.loop.start([constrained, plain])
        assert grammars.compiling.wait(5)
        out = final_of(served.sent, plain, 1.0 if inline else 10.0)
        if inline:
            assert out is None and not served.rt.runs
            return
        assert out is not None and out.finish == "length" and plain.generated == 12
        assert final_of(served.sent, constrained, 0.1) is None  # still compiling
        runs = served.rt.runs
        grammars.release.set()
        out = final_of(served.sent, constrained, 10.0)
        assert out is not None and out.finish == "stop" and out.error is None
        assert constrained.generated >= 1  # "ok": its forced tokens
        assert served.rt.runs > runs  # its START ran after the release
    finally:
        grammars.release.set()
        served.loop.close()
        served.senders.stop()
        served.batcher.stop()
        served.local.stop()


@pytest.mark.parametrize("watched", [True, False], ids=["watched", "control: unwatched"])
def test_a_stream_cancelled_while_its_constraint_compiles_ends_unstarted(
        private_tmp, tokenizer_dir, monkeypatch, watched):
    """A constrained stream whose client went away while its compile is held: the generate
    model's loop looks at quiet streams too, so the cancel reaches the sequence model, which
    answers it at once (CANCELLED) and never sends its START. Control: without that watch
    (a stream is only looked at when a token comes), nothing is cancelled while the compile
    is held."""
    if not watched:
        monkeypatch.setattr(LocalLoop, "_watch_quiet", lambda self, conn: None)
    grammars = HeldGrammars(tokenizer_dir)
    served = Served(0.002, cancelled=True, grammars=grammars)
    stream = LocalStream(None, [5, 6], SamplingParams.from_dict(
        {"max_tokens": 8, "structured_output": {"regex": "[0-9]+"}}), False,
        TextStream(lambda ids: "", ()), {0}, time.perf_counter())
    try:
        served.loop.start([stream])
        assert grammars.compiling.wait(5)
        out = final_of(served.sent, stream, 2.0)
        if not watched:
            assert out is None
            return
        assert out is not None and out.error[0] == "CANCELLED"
        grammars.release.set()
        time.sleep(0.2)  # the compile ends: nothing is started for it
        assert not served.rt.runs and not served.batcher.sequences
        assert not served.local.connections[0].generations
    finally:
        grammars.release.set()
        served.loop.close()
        served.senders.stop()
        served.batcher.stop()
        served.local.stop()

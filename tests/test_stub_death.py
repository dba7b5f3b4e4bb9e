"""A model process killed under `tlaloc serve`, as a user runs it: Triton 2.51 would keep the
model ready, never answer its in-flight requests and fail every new one. `tlaloc serve`
notices the dead process, stops the server (the in-flight stream ends with an error, not a
hang) and starts it again; the model serves transformers' ids again within a minute."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from oracle import load_reference, reference_greedy

from triton_tlaloc.frontends.client import TlalocClient, generate
from triton_tlaloc.frontends.tokenizer import ArtifactTokenizer
from triton_tlaloc.repository import RepositoryOptions, write_repository
from triton_tlaloc.server import free_port, processes_named, stub_processes

STEPS = 8


def wait_for_line(path, text: str, count: int, timeout_s: float) -> float:
    """Seconds until `path` holds `text` `count` times; fails past `timeout_s`."""
    t0 = time.monotonic()
    while path.read_text(errors="replace").count(text) < count:
        assert time.monotonic() - t0 < timeout_s, path.read_text(errors="replace")[-3000:]
        time.sleep(0.2)
    return time.monotonic() - t0


def kill_mid_generation(out, grpc_url, serve_pid, model, prompt, restarts):
    """SIGKILL `model`'s process while a generation streams: the stream ends with an error
    within the server's exit timeout, and the server is ready again within a minute."""
    server_pid, = processes_named("tritonserver", parent=serve_pid)
    stub = next(s for s in stub_processes(server_pid) if s.model == model)
    first, ended = threading.Event(), {}

    def stream():
        ended["result"] = generate(grpc_url, "smollm2_generate", input_ids=prompt,
                                   timeout_s=60, on_text=lambda _: first.set(),
                                   sampling={"max_tokens": 100, "ignore_eos": True})
    streaming = threading.Thread(target=stream)
    streaming.start()
    assert first.wait(60), "the generation sent nothing"
    killed = time.monotonic()
    os.kill(stub.pid, signal.SIGKILL)
    streaming.join(30)
    assert not streaming.is_alive(), f"{model} killed: the in-flight generation hung"
    result = ended["result"]
    print(f"{model} killed: the in-flight stream ended {time.monotonic() - killed:.1f} s later, "
          f"{len(result.token_ids)} tokens, error {result.error!r}")
    assert result.error is not None and len(result.token_ids) < 100
    wait_for_line(out, "ready: HTTP", restarts + 1, 60)
    print(f"{model} killed: ready again {time.monotonic() - killed:.1f} s later")
    text = out.read_text(errors="replace")
    assert f"model process of {model} (pid {stub.pid}) died: restarting tritonserver " \
        f"({restarts} of at most 3)" in text, text[-2000:]


def test_a_killed_model_process_is_noticed_and_the_model_comes_back(smollm2, tmp_path):
    gguf, art = smollm2
    repo = tmp_path / "repo"
    write_repository(art, repo, "smollm2", RepositoryOptions())
    tok = ArtifactTokenizer(art / "tokenizer")
    prompt = tok.apply_chat_template([{"role": "user",
                                       "content": "What is the capital of France?"}])
    want, _ = reference_greedy(load_reference(gguf.parent, gguf_file=gguf.name), prompt, STEPS)
    ports = [free_port() for _ in range(3)]
    out = tmp_path / "serve.out"
    serve = subprocess.Popen(
        [sys.executable, "-m", "triton_tlaloc.cli", "serve", str(repo),
         "--http-port", str(ports[0]), "--grpc-port", str(ports[1]),
         "--metrics-port", str(ports[2]), "--exit-timeout", "3"],
        stdout=open(out, "wb"), stderr=subprocess.STDOUT)
    grpc_url = f"127.0.0.1:{ports[1]}"
    try:
        wait_for_line(out, "ready: HTTP", 1, 300)
        with TlalocClient(grpc_url, "smollm2") as c:
            assert c.generate_greedy(prompt, STEPS).generated_ids == want
        for restarts, model in enumerate(("smollm2", "smollm2_generate"), start=1):
            kill_mid_generation(out, grpc_url, serve.pid, model, prompt, restarts)
            with TlalocClient(grpc_url, "smollm2") as c:
                assert c.generate_greedy(prompt, STEPS).generated_ids == want
            got = generate(grpc_url, "smollm2_generate", input_ids=prompt,
                           sampling={"max_tokens": STEPS, "ignore_eos": True})
            assert got.error is None and got.token_ids == want
    finally:
        serve.send_signal(signal.SIGINT)
        rc = serve.wait(60)
    assert rc == 0, out.read_text(errors="replace")[-2000:]

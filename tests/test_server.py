"""A real tritonserver (from the nvidia-pytriton wheel) serving tiny artifacts, over HTTP and
gRPC: transformers' greedy ids, concurrent sequences, donation, and every refusal. The checks
are checks/sequence_checks.py's, which scripts/verify.py tabulates too."""

from __future__ import annotations

import json

import pytest
from checks.oracle import load_reference, reference_greedy

from checks import sequence_checks as S
from checks.sequence_checks import PLACEHOLDER, TINY_PROMPT as PROMPT, assert_check

from triton_tlaloc.frontends.client import TlalocClient
from triton_tlaloc.engine.core import Engine
from triton_tlaloc.export import ExportOptions, export_artifact
from triton_tlaloc.repository import RepositoryOptions, write_repository
from triton_tlaloc.runtime.core import Runtime
from triton_tlaloc.triton.server import TritonServer

pytestmark = pytest.mark.tritonserver

PROTOCOLS = ["http", "grpc"]


@pytest.fixture(scope="module")
def served(tiny, work):
    """One server for the module: llama, qwen3, llama with donate_kv_pools false, a small
    model (a pool of 8 pages of 8 tokens, contexts 32 and 64, an image placeholder id), and
    llama with verify entries (speculation)."""
    ckpt = tiny.checkpoint("llama", False)
    small_ckpt = work / "ckpt-small"
    if not small_ckpt.exists():
        import shutil
        shutil.copytree(ckpt, small_ckpt)
        cfg = json.loads((small_ckpt / "config.json").read_text())
        cfg["image_token_id"] = PLACEHOLDER
        (small_ckpt / "config.json").write_text(json.dumps(cfg))
    small = export_artifact(small_ckpt, work / "art-small",
                            ExportOptions(batch_ladder=(1, 2), context_ladder=(32, 64),
                                          block_size=8, num_blocks=9))
    arts = {"llama": tiny.artifact("llama", False), "qwen3": tiny.artifact("qwen3", True),
            "small": small,
            "llama_int8_fp8kv": tiny.artifact("llama", False, weight_quant="int8", kv_dtype="fp8"),
            # verify entries for drafts of up to 4 and 8 tokens
            "llama_spec": tiny.artifact("llama", False, verify_tokens=(5, 9))}
    repo = work / "repo"
    for name, art in arts.items():
        # The small pool's checks are of refusals: no host tier (it would swap instead). No
        # generate models: these tests use none (tests/test_generate.py has them).
        write_repository(art, repo, name, RepositoryOptions(
            max_sequence_idle_microseconds=600_000_000, generate_model=False,
            host_kv_bytes=0 if name == "small" else None))
    write_repository(arts["llama"], repo, "llama_copied",
                     RepositoryOptions(donate_kv_pools=False, generate_model=False))
    server = TritonServer(repo, exit_timeout_s=3).start(wait_compiled=False)
    yield server, arts
    server.stop()


def client_for(served, protocol) -> TlalocClient:
    server, _ = served
    return TlalocClient(S.url_of(server, protocol), "llama", protocol)


def use(client: TlalocClient, model: str) -> TlalocClient:
    client.model = model
    return client


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("model,family,tied", [("llama", "llama", False), ("qwen3", "qwen3", True)])
def test_greedy_ids_equal_transformers(served, tiny, protocol, model, family, tied):
    want, _ = reference_greedy(load_reference(tiny.checkpoint(family, tied)), PROMPT, 16)
    with use(client_for(served, protocol), model) as client:
        assert_check(S.check_greedy_ids(client, PROMPT, want))


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_four_concurrent_sequences_equal_their_solo_runs(served, protocol):
    server, arts = served
    prompts = [PROMPT[:n] for n in (3, 7, 12, 20)]
    engine = Engine(Runtime(arts["llama"]))
    solo = [engine.generate_greedy(p, 12).generated_ids for p in prompts]
    assert_check(S.check_concurrent_solo(S.url_of(server, protocol), protocol, "llama", prompts,
                                         12, solo=solo))


def test_donation_in_place_and_the_control_copied_with_the_same_ids(served):
    server, _ = served
    assert_check(S.check_donation(server, "llama", "llama_copied"))


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_refusals_leave_the_sequence_to_continue_with_its_solo_ids(served, protocol):
    """Each refusal by code and by a message naming the sequence (an id outside the vocabulary,
    negative or not, the image placeholder, no tokens, past the largest context); the sequence
    then continues with its solo ids; a placeholder or an over-long prompt in a START is refused
    too."""
    _, arts = served
    prompt = [1, 17, 99, 3, 200]
    solo = Engine(Runtime(arts["small"])).generate_greedy(prompt, 6).generated_ids
    with use(client_for(served, protocol), "small") as client:
        assert_check(S.check_refusals(
            client, protocol, solo, prompt,
            sequence_cases=S.SEQUENCE_REFUSALS + (S.NEGATIVE_ID_REFUSAL,),
            start_cases=(S.PLACEHOLDER_START_REFUSAL,) + S.START_REFUSALS))


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_full_pool_refused_as_unavailable_then_the_same_request_succeeds(served, protocol):
    _, arts = served
    solo_b = Engine(Runtime(arts["small"])).generate_greedy(list(range(20, 44)), 4).generated_ids
    with use(client_for(served, protocol), "small") as client:
        assert_check(S.check_full_pool(client, protocol, solo_b))
        # a sequence at the largest context: one more step is refused by name
        assert_check(S.check_largest_context_step(client, protocol))


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_int8_weights_and_fp8_kv_served(served, tiny, protocol):
    """int8 linears and fp8 KV pools through Triton: transformers computing with the dequantized
    weights and e4m3fn-rounded keys and values gives the same ids; the metrics report the
    weight and pool bytes."""
    from checks.oracle import fp8_kv_reference, quantized_reference

    server, arts = served
    model = quantized_reference(load_reference(tiny.checkpoint("llama", False)), "int8")
    with fp8_kv_reference(model):
        want, _ = reference_greedy(model, PROMPT, 16)
    with use(client_for(served, protocol), "llama_int8_fp8kv") as client:
        assert_check(S.check_greedy_ids(client, PROMPT, want))
    assert_check(S.check_quantized_bytes(server.metrics_url, "llama_int8_fp8kv", "llama",
                                         arts["llama_int8_fp8kv"], arts["llama"]))


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_small_outputs_on_every_step(served, protocol):
    """ARGMAX equals the argmax of LOGITS on each step of a 32-step run, TOP_K their K largest
    log-probabilities; a request naming only ARGMAX gets 4 bytes and no LOGITS; the greedy ids
    through ARGMAX equal those through LOGITS; a bad top_k is refused by name."""
    with use(client_for(served, protocol), "llama") as client:
        assert_check(S.check_small_outputs(client, PROMPT, steps=32, k=4))


def test_metrics_on_the_metrics_port(served):
    server, arts = served
    with use(client_for(served, "http"), "llama") as client:
        assert_check(S.check_metrics(server.metrics_url, client, arts["llama"], free_pages=32))


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_drafts_verified_by_the_server_give_transformers_greedy_ids(served, tiny, protocol):
    """Prompt lookup at 1-8 drafts a step, random drafts, and drafting beside two sequences
    decoding plainly: transformers' greedy ids every time. A model without verify entries and
    a bad draft_tokens are refused by name, and the sequence goes on."""
    server, _ = served
    want, _ = reference_greedy(load_reference(tiny.checkpoint("llama", False)), PROMPT, 40)
    assert_check(S.check_speculation(S.url_of(server, protocol), protocol, "llama_spec", PROMPT,
                                     want, others=(PROMPT[:7], PROMPT[5:17])))
    with use(client_for(served, protocol), "llama") as client:
        assert_check(S.check_speculation_refusals(client, PROMPT, want[:16],
                                                  "no verify entries"))


def test_a_model_that_fails_to_load_is_named_with_its_own_error(tiny, tmp_path):
    """tritonserver's last line says only "failed to load all models": the error names the
    model and its own first error line (what `tlaloc serve` prints)."""
    from triton_tlaloc.triton.server import ServerError

    repo = tmp_path / "repo"
    write_repository(tiny.artifact("llama", False), repo, "broken",
                     RepositoryOptions(copy=True, generate_model=False))
    weight = sorted((repo / "broken" / "1" / "artifact" / "weights").iterdir())[0]
    weight.write_bytes(b"\0" * 100)
    server = TritonServer(repo, exit_timeout_s=3)
    with pytest.raises(ServerError) as e:
        server.start(timeout_s=120)
    first = str(e.value).splitlines()[:2]
    assert first[0] == "tritonserver exited with 1", first
    assert first[1].startswith("  model broken failed to load: ") and \
        "ArtifactError: weight slot" in first[1] and "file holds 100 bytes" in first[1], first


def test_a_server_that_triton_aborts_as_it_starts_is_started_again(tiny, tmp_path):
    """Triton's Python backend now and then aborts while it starts a model's process (a mutex in
    its shared memory throws `boost::interprocess::lock_exception`): `start` starts it once more.
    A stand-in tritonserver aborts so on its first run, then runs the real one, which serves.
    Controls: an abort with any other message, or that one twice, is raised."""
    from triton_tlaloc.triton.server import ServerError

    repo = tmp_path / "repo"
    write_repository(tiny.artifact("llama", False), repo, "llama",
                     RepositoryOptions(generate_model=False))

    def server_aborting(times: int, message: str) -> tuple[TritonServer, object]:
        server = TritonServer(repo, exit_timeout_s=3)
        runs = tmp_path / f"runs-{len(list(tmp_path.iterdir()))}"
        fake = runs.with_suffix(".sh")
        fake.write_text(f"""#!/bin/sh
echo run >> {runs}
if [ "$(wc -l < {runs})" -le {times} ]; then echo "{message}"; kill -ABRT $$; fi
exec {server.args[0]} "$@"
""")
        fake.chmod(0o755)
        server.args[0] = str(fake)
        return server, lambda: len(runs.read_text().splitlines())

    lock = f"terminate called after throwing an instance of '{TritonServer.SHM_LOCK_ABORT}'"
    server, runs = server_aborting(1, lock)
    with server.start(timeout_s=120, wait_compiled=False):
        assert runs() == 2
        with TlalocClient(server.grpc_url, "llama") as c:
            assert len(c.generate_greedy(PROMPT, 4).generated_ids) == 4
    for times, message, want_runs in ((1, "terminate called: something else", 1),
                                      (2, lock, 2)):
        server, runs = server_aborting(times, message)
        with pytest.raises(ServerError, match="exited with -6"):
            server.start(timeout_s=60)
        assert runs() == want_runs

"""More than one device behind tritonserver, on the CPU (each instance's process gives itself
the virtual devices it needs): a tiny llama exported for 2 devices (one instance of kind
KIND_CPU over both) gives transformers' ids over HTTP and gRPC, alone and batched, through the
sequence model and the generate model, each device holding its half of the KV; the one-device
artifact as 2 data-parallel instances spreads 8 concurrent sequences over both, each with its
solo ids, also through its generate model, whose generations go to both. The checks are checks/device_checks.py's, which scripts/verify.py tabulates too."""

from __future__ import annotations

import re
import time

import pytest
from checks.oracle import load_reference, reference_greedy

from checks import device_checks as D
from checks import sequence_checks as S
from checks.sequence_checks import assert_check

from triton_tlaloc.export import ExportOptions, export_artifact
from triton_tlaloc.frontends.client import TlalocClient, generate
from triton_tlaloc.repository import RepositoryOptions, write_repository
from triton_tlaloc.triton.server import TritonServer

pytestmark = pytest.mark.tritonserver

OPTS = dict(batch_ladder=(1, 2, 4), context_ladder=(32, 64), block_size=8, prefill_chunk=16)
PROMPTS = [[(i * 53 + k * 11 + 7) % 240 + 10 for i in range(12 + 3 * k)] for k in range(8)]
STEPS = 10


@pytest.fixture(scope="module")
def served(tiny, work):
    ckpt = tiny.checkpoint("llama", False)
    arts = {n: export_artifact(ckpt, work / f"art-llama-devices-{n}",
                               ExportOptions(**OPTS, tensor_parallel=n)) for n in (1, 2)}
    repo = work / "repo-devices"
    write_repository(arts[2], repo, "llama_tp2", RepositoryOptions())
    write_repository(arts[1], repo, "llama_dp2", RepositoryOptions(instances=2))
    server = TritonServer(repo, exit_timeout_s=3).start(wait_compiled=False)
    yield server, arts
    server.stop()


@pytest.fixture(scope="module")
def reference(tiny):
    model = load_reference(tiny.checkpoint("llama", False))
    return [reference_greedy(model, p, STEPS)[0] for p in PROMPTS]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_two_devices_give_transformers_ids_alone_and_batched(served, reference, protocol):
    server, _ = served
    assert_check(S.check_alone_and_batched(S.url_of(server, protocol), protocol, "llama_tp2",
                                           PROMPTS[:4], reference[:4], STEPS))


def test_the_generate_model_on_two_devices(served, reference):
    server, _ = served
    assert_check(S.check_generate_model(server.grpc_url, "llama_tp2", PROMPTS[5],
                                        reference[5]))


def test_each_device_holds_half_the_kv(served, reference):
    server, arts = served
    with TlalocClient(server.grpc_url, "llama_tp2", "grpc") as c:  # the model has run
        assert c.generate_greedy(PROMPTS[0], 2).generated_ids == reference[0][:2]
    assert_check(D.check_split_bytes(server.metrics_url, "llama_tp2", arts[2], arts[1]))


def test_two_instances_share_eight_sequences(served, reference):
    server, _ = served
    assert_check(D.check_data_parallel(server.grpc_url, "grpc", "llama_dp2", PROMPTS,
                                       reference, STEPS, server.metrics_url, 2))


def test_generations_spread_over_the_instances(served, reference):
    """The generate model finds both instances' local links and starts each generation on the
    one with fewer. It looks for the next instance's link as a generation comes, and tries a
    link that did not answer again 5 s later (local_streams.RECONNECT_S): a loaded CI
    machine once sent a whole batch while instance 1's first try had failed, so the check
    waits until both are found, as a user's later generations find them."""
    server, _ = served
    deadline = time.monotonic() + 60
    while "generations spread over llama_dp2's instances: 2 found" not in server.log_text():
        assert time.monotonic() < deadline, "the generate model did not find instance 1"
        generate(server.grpc_url, "llama_dp2_generate", input_ids=PROMPTS[0],
                 sampling={"max_tokens": 1})
        time.sleep(0.5)
    assert_check(D.check_generate_spread(server.grpc_url, "llama_dp2", PROMPTS, reference,
                                         server.metrics_url, 2))


def test_the_config_places_the_instances(served, work):
    """On GPUs, an instance over several devices and several instances are KIND_MODEL with
    their devices named (as vllm_backend's are); on the CPU each instance's process has its
    own devices. A device list of the wrong length is refused by name."""
    _, arts = served
    repo = work / "repo-placement"

    def config(art, **opts):
        model = write_repository(art, repo, "m", RepositoryOptions(generate_model=False, **opts))
        text = (model / "config.pbtxt").read_text()
        group = re.search(r"instance_group \[ \{ count: (\d+) kind: (\w+) \} \]", text)
        params = dict(re.findall(r'key: "(\w+)" value: \{ string_value: "([^"]*)" \}', text))
        return int(group.group(1)), group.group(2), params.get("devices"), params.get("platform")
    assert config(arts[1], instance_kind="gpu") == (1, "KIND_GPU", None, None)
    assert config(arts[2], instance_kind="gpu", instances=2) == (2, "KIND_MODEL", "0,1,2,3",
                                                                 "cuda")
    assert config(arts[2], instance_kind="gpu", devices=(6, 7)) == (1, "KIND_MODEL", "6,7",
                                                                    "cuda")
    assert config(arts[2], instances=2) == (2, "KIND_CPU", None, None)
    with pytest.raises(ValueError, match=r"2 instance\(s\) of an artifact lowered for 2 "
                                         r"device\(s\) need 4 distinct devices"):
        config(arts[2], instance_kind="gpu", instances=2, devices=(0, 1, 2))

"""Programs that are not language models, served by a real tritonserver: a bounded
program at every length, a ragged batch grouped by row shape, nine dtypes, a program with state
kept in place, refusals by name. The checks are shared with scripts/verify.py (programs.py)."""

from __future__ import annotations

import pytest

from checks import programs as P
from checks.sequence_checks import assert_check, url_of
from triton_tlaloc.repository import ProgramOptions, write_program_repository
from triton_tlaloc.programs.generic import ProgramError
from triton_tlaloc.triton.server import TritonServer

pytestmark = pytest.mark.tritonserver

PROTOCOLS = ("http", "grpc")


@pytest.fixture(scope="module")
def built(work):
    return P.build_programs(work / "programs")


@pytest.fixture(scope="module")
def served(built, work):
    repo = work / "programs-repo"
    P.write_program_models(built, repo)
    server = TritonServer(repo, log_path=work / "programs-server.log", exit_timeout_s=3).start(
        wait_compiled=False)
    yield server
    server.stop()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_bounded_program_at_every_length(served, protocol):
    assert_check(P.check_bounded_every_length(url_of(served, protocol), protocol))


def test_bounded_tolerance_tells_a_padded_mean(work):
    assert_check(P.check_bounded_negative_control(work / "programs"))


def test_ragged_batch_grouped_by_row_shape(served):
    assert_check(P.check_ragged_batch(served.grpc_url, served.metrics_url))


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_nine_dtypes_round_trip(served, protocol):
    assert_check(P.check_dtypes(url_of(served, protocol), protocol))


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_state_kept_between_requests_in_place(served, protocol):
    assert_check(P.check_running_sum(url_of(served, protocol), protocol, served.metrics_url))


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_bad_requests_refused_state_untouched(served, protocol):
    assert_check(P.check_refusals(url_of(served, protocol), protocol))


def test_the_model_log_names_what_was_loaded(served):
    log = served.log_text()
    assert "[tlaloc rows] model rows loaded" in log and "group_by_shape true" in log
    assert "[tlaloc running_sum] model running_sum loaded" in log
    assert "state kept between requests" in log


def test_repository_refuses_what_cannot_serve(built, tmp_path):
    sums = dict(arguments="input:X,state:total", results="output:TOTAL,state:total")
    with pytest.raises(ProgramError, match="a program with state runs one request at a time"):
        write_program_repository(built["running_sum"], tmp_path, "s",
                                 ProgramOptions(**sums, max_batch_size=4))
    with pytest.raises(ProgramError, match="@main takes 2 arguments"):
        write_program_repository(built["running_sum"], tmp_path, "s",
                                 ProgramOptions(arguments="input:X", results="output:T"))
    with pytest.raises(ProgramError, match=r"weight:absent.bin\): no such file"):
        write_program_repository(built["rows"], tmp_path, "r", ProgramOptions(
            arguments="input:X,weight:absent.bin", results="output:Y"))
    with pytest.raises(ProgramError, match="state t: needs exactly one result"):
        write_program_repository(built["running_sum"], tmp_path, "s", ProgramOptions(
            arguments="input:X,state:t", results="output:TOTAL,output:T2"))
    with pytest.raises(ProgramError, match="max_batch_size must be 0"):
        write_program_repository(built["masked_mean"], tmp_path, "m",
                                 ProgramOptions(max_batch_size=4))
    config = (write_program_repository(built["rows"], tmp_path, "r", ProgramOptions(
        arguments="input:X,weight:scale.bin", results="output:Y", max_batch_size=8))
        / "config.pbtxt").read_text()
    assert 'dims: [ -1 ] allow_ragged_batch: true' in config
    assert "dynamic_batching" in config and "max_batch_size: 8" in config

"""The vLLM lane's fixtures (vllm_lane.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # vllm_lane, beside this file

from vllm_lane import exported_fixture  # noqa: E402

exported = pytest.fixture(scope="session")(exported_fixture)


def pytest_configure(config):
    # tests/conftest.py groups tests for pytest-xdist, which the lane does not install
    config.addinivalue_line("markers", "xdist_group(name): pytest-xdist's grouping")

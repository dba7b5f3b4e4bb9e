"""Tests that need several devices: this process's CPU client gets four (XLA_FLAGS, set before
JAX starts). tests/test_multi_device_suite.py runs this directory in a process of its own, as
the main suite's process has one device."""

from __future__ import annotations

import os
import sys

DEVICES = 4

if "jax" not in sys.modules:
    os.environ["XLA_FLAGS"] = (f"{os.environ.get('XLA_FLAGS', '')} "
                               f"--xla_force_host_platform_device_count={DEVICES}").strip()

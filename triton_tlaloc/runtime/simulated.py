"""A benchmark mode: every entry's executable replaced by a wait of a fixed duration.

With model parameter `simulate_step_ms` the sequence model compiles nothing and uploads
nothing: each call waits that long (the GIL released, as while a device runs) and returns logits
that depend only on each row's last token and position. Everything else runs as served: Triton,
the requests and responses, the batcher and its page policy, the step inputs, the generate
model and the OpenAI front end. It measures what the serving path costs at a device's step rate
and at batch sizes this machine cannot run (scripts/simulated_bench.py).

The logits are not a model's, so the mode is refused unless the server's environment says it is
a benchmark (TLALOC_BENCHMARK_MODE=1): a repository alone cannot turn it on.
"""

from __future__ import annotations

import os
import time

import numpy as np

from ..artifact.manifest import Artifact

BENCHMARK_ENV = "TLALOC_BENCHMARK_MODE"


def simulated_step_s(value: str) -> float | None:
    """The `simulate_step_ms` parameter in seconds, None when unset; ValueError (naming the
    problem) when it is not a number >= 0 or the environment does not allow it."""
    if value in ("", None):
        return None
    try:
        ms = float(value)
    except ValueError:
        raise ValueError(f"simulate_step_ms must be a number of milliseconds, not {value!r}")
    if not ms >= 0:
        raise ValueError(f"simulate_step_ms must be >= 0, not {value}")
    if os.environ.get(BENCHMARK_ENV) != "1":
        raise ValueError(f"simulate_step_ms replaces the model by a wait and is a benchmark mode: "
                         f"set {BENCHMARK_ENV}=1 in tritonserver's environment to use it")
    return ms / 1e3


def simulated_argmax(tokens: np.ndarray, positions: np.ndarray, vocab: int) -> np.ndarray:
    """The simulated model's next token after each position: a function of the token and the
    position only, so a sequence's ids depend on nothing but its own tokens (batched equals
    solo)."""
    return ((tokens.astype(np.int64) * 31 + positions + 7) % vocab).astype(np.int32)


def one_hot(hot: np.ndarray, vocab: int) -> np.ndarray:
    """Logits [..., vocab] that are 1 at each of `hot`'s ids and 0 elsewhere."""
    logits = np.zeros((*hot.shape, vocab), np.float32)
    np.put_along_axis(logits, hot[..., None].astype(np.int64), 1.0, axis=-1)
    return logits


def simulated_logits(tokens: np.ndarray, positions: np.ndarray, vocab: int) -> np.ndarray:
    """Each row's logits after its last token: one-hot at `simulated_argmax`."""
    return one_hot(simulated_argmax(tokens[:, -1], positions[:, -1], vocab), vocab)


class SimulatedRuntime:
    """engine.StepRuntime over an artifact whose entries are waits of `step_s` seconds."""

    def __init__(self, artifact: Artifact, step_s: float):
        self.artifact = artifact
        self.step_s = step_s
        self.executables = dict.fromkeys(artifact.entries)
        self.entries_total = len(self.executables)
        self.phase_seconds = {"inputs": 0.0, "execute": 0.0, "copy": 0.0}
        self.weight_bytes = self.kv_pool_bytes = self.state_pool_bytes = 0
        self.on_compiled = None
        self.runs = 0

    def run(self, entry_name: str, step: dict[str, np.ndarray]) -> np.ndarray:
        self._execute(entry_name)
        return simulated_logits(step["TOKEN_IDS"], step["POSITIONS"], self.artifact.model.vocab)

    def run_positions(self, entry_name: str, step: dict[str, np.ndarray],
                      logits: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
        self._execute(entry_name)
        argmax = simulated_argmax(step["TOKEN_IDS"], step["POSITIONS"], self.artifact.model.vocab)
        return argmax, one_hot(argmax, self.artifact.model.vocab) if logits else None

    def _execute(self, entry_name: str) -> None:
        """The call's wait, counted as the executable's time."""
        assert entry_name in self.executables, entry_name
        t0 = time.perf_counter()
        time.sleep(self.step_s)
        self.phase_seconds["execute"] += time.perf_counter() - t0
        self.runs += 1

    def want(self, entry_name: str) -> None:
        pass

    def compiling(self, entry_name: str) -> bool:
        return False

    def wait_for(self, entry_name: str) -> None:
        pass

    def close(self) -> None:
        pass

"""Negative controls' artifacts: a copy of an artifact with some weights' values changed and
the manifest as it was, so a check can show a known-wrong weight fails its tolerance."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import numpy as np

from triton_tlaloc.artifact.manifest import MANIFEST_NAME, numpy_dtype


def weight_arrays(art: Path, slots) -> dict[str, np.ndarray]:
    """The arrays of an artifact's weight slots by name, in their shapes and dtypes."""
    weights = {w["slot"]: w for w in json.loads((art / MANIFEST_NAME).read_text())["weights"]}
    return {slot: np.fromfile(art / weights[slot]["file"], numpy_dtype(weights[slot]["dtype"]))
            .reshape(weights[slot]["shape"]) for slot in slots}


def with_weights_changed(src: Path, dest: Path,
                         changes: dict[str, Callable[[np.ndarray], np.ndarray]]) -> Path:
    """`src` copied to `dest`, each slot named in `changes` rewritten as its function of the
    slot's array (in its shape and dtype) returns; returns `dest`."""
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(src, dest)
    weights = {w["slot"]: w for w in json.loads((dest / MANIFEST_NAME).read_text())["weights"]}
    for slot, arr in weight_arrays(dest, changes).items():
        (dest / weights[slot]["file"]).write_bytes(
            np.ascontiguousarray(changes[slot](arr)).tobytes())
    return dest

"""What every TritonPythonModel of this package shares: reading the model's configuration and
parameters, logging into Triton's log, and error responses with a code.

The sequence model (model.py), the generate model (triton/generate_model.py) and the program
model (programs/model.py) import this module and nothing of each other, so each stub process
loads only what its model uses. It imports `triton_python_backend_utils`, which exists only
inside Triton's Python backend stub.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import NamedTuple

import triton_python_backend_utils as pb_utils


class TritonLogHandler(logging.Handler):
    """Our loggers into Triton's log (so INFO lines appear in the server log)."""

    def emit(self, record):
        msg = self.format(record)
        if record.levelno >= logging.ERROR:
            pb_utils.Logger.log_error(msg)
        elif record.levelno >= logging.WARNING:
            pb_utils.Logger.log_warn(msg)
        else:
            pb_utils.Logger.log_info(msg)


def setup_logging(model_name: str) -> None:
    """Send the package's loggers to Triton's log, prefixed with the model's name (each model
    instance runs in a stub process of its own)."""
    logger = logging.getLogger("triton_tlaloc")
    if not any(isinstance(h, TritonLogHandler) for h in logger.handlers):
        handler = TritonLogHandler()
        handler.setFormatter(logging.Formatter(f"[tlaloc {model_name}] %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def parse_bool(text: str) -> bool:
    """A boolean model parameter; anything but true/false/1/0/yes/no is refused by name."""
    v = text.strip().lower()
    if v not in ("true", "false", "1", "0", "yes", "no"):
        raise ValueError(f"expected true or false, got {text!r}")
    return v in ("true", "1", "yes")


class ModelSettings(NamedTuple):
    config: dict  # the model's configuration, as Triton hands it over
    params: dict[str, str]  # its parameters over the model's defaults
    version_dir: Path  # REPO/NAME/VERSION: relative paths in parameters resolve here
    platform: str  # the PJRT platform: the parameter `platform`, else the instance group's kind
    device: int  # the device the instance group names (one PJRT client per device)
    instance: int  # this instance's index in its group (Triton names it MODEL_GROUP_INDEX)


def model_settings(args: dict, defaults: dict[str, str]) -> ModelSettings:
    """Read initialize()'s `args`: the configuration, its parameters (string values) over
    `defaults`, the version directory, and the platform and device of this instance."""
    config = json.loads(args["model_config"])
    params = dict(defaults)
    for key, value in config.get("parameters", {}).items():
        params[key] = value["string_value"]
    version_dir = Path(args["model_repository"]) / str(args["model_version"])
    kind = args.get("model_instance_kind", "CPU")
    platform = params.get("platform") or ("cuda" if kind == "GPU" else "cpu")
    device = int(args.get("model_instance_device_id", 0)) if platform != "cpu" else 0
    index = args.get("model_instance_name", "").rsplit("_", 1)[-1]
    return ModelSettings(config, params, version_dir, platform, device,
                         int(index) if index.isdigit() else 0)


def triton_error(message: str, code: str) -> "pb_utils.TritonError":
    """A TritonError whose code is named by a string ("INVALID_ARG", "UNAVAILABLE", "INTERNAL",
    "CANCELLED"): the pure-Python parts (batcher.Reply) name codes without importing Triton.
    Without a code a client sees INTERNAL / HTTP 500 whatever the problem, so every error
    carries one."""
    # The codes are attributes bound only once the stub runs a model, not at import time.
    return pb_utils.TritonError(message, getattr(pb_utils.TritonError, code))


def error_response(message: str, code: str) -> "pb_utils.InferenceResponse":
    """A response that carries only an error."""
    return pb_utils.InferenceResponse(output_tensors=[], error=triton_error(message, code))

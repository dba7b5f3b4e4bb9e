"""triton-tlaloc: decoder language models served by NVIDIA Triton Inference Server's Python
backend, from Tlaloc serving artifacts compiled with JAX's PJRT client.

The public API is importable from here, e.g. `from triton_tlaloc import TlalocClient,
TritonServer, export_artifact`. Each name loads its module when first used, so importing the
package stays light (no JAX until an exporter or a runtime is asked for). The modules that hold
them may move; these names do not.
"""

from __future__ import annotations

import importlib

# name -> the module (under triton_tlaloc) that defines it
_PUBLIC = {
    # Clients of a served model (frontends/client.py)
    "TlalocClient": "frontends.client",
    "InferError": "frontends.client",
    "GenerateResult": "frontends.client",
    "generate": "frontends.client",
    "new_sequence_id": "frontends.client",
    "scrape_metrics": "frontends.client",
    "metric": "frontends.client",
    # Exporting: language models, and JAX functions that are not (programs/)
    "ExportOptions": "export",
    "ExportError": "export",
    "export_artifact": "export",
    "export_program": "programs.generic",
    "export_bounded": "programs.bounded",
    "TensorShape": "programs.bounded",
    "load_artifact": "artifact.loading",
    # Repositories and the server
    "RepositoryOptions": "repository",
    "write_repository": "repository",
    "ProgramOptions": "repository",
    "write_program_repository": "repository",
    "TritonServer": "triton.server",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'triton_tlaloc' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

"""Glue to Triton's Python backend: settings, metrics, replies, the generate model, the server."""

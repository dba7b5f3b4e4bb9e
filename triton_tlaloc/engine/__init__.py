"""The engine: entries chosen, prefill, decode and verify calls, step inputs."""

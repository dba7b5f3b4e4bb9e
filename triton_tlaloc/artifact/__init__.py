"""The artifact: its format and loader, StableHLO readers, tensor parallelism as recorded."""

"""What a sequence holds of the KV cache: the sequence, its pools, one manager per cache kind, the
host tier."""

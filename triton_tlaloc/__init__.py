"""triton-tlaloc."""

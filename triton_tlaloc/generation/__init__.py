"""Generating text: sampling, speculation and drafting, a generate model's loop in this process."""

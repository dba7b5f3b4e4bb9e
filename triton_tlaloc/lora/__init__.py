"""LoRA adapters on one base model: the artifact's adapter pools (layout.py) and PEFT
adapters read into them (peft_adapter.py). Pure numpy: no JAX, torch or Triton."""

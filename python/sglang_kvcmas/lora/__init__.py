"""LoRA deltas computed without an accelerator (pure PyTorch; SGLang's backend wraps them)."""

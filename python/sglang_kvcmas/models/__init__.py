"""Model resolution: the embedded default, HF folders, GGUF files."""

"""Model resolution (embedded default, HF folders, GGUF) and a reference Llama forward."""

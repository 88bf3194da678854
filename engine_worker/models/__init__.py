"""The engine's own model implementations: one file per family (llama.py, qwen2.py,
gemma.py, ...) built from shared layers (layers/), listed by the registry
(registry.py: load_model_config reads a folder's config by it), and built from a
checkpoint, a GGUF file or random weights by the loader (loader.py: load_model)."""

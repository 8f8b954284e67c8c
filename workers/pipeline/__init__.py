"""The fitted pipeline: load → plan → apply (quantization, offload, caches, attention, compile) → call."""

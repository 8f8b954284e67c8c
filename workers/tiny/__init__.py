"""Random-weight test pipelines built from the real diffusers/transformers classes (demo and tests)."""

"""One device's work, with no Ray: load a pipeline, generate shards, write outputs and manifests."""

import os

# Library chatter (deprecations, optional-backend notices) would repeat once per actor in the
# driver's log; keep warnings of our own and errors. Set these yourself to see more.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")

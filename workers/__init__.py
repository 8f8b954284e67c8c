"""One device's work, with no Ray: load a pipeline, generate shards, write outputs and manifests."""

import os

# transformers' chatter (deprecations, optional-backend notices) would repeat once per actor in the
# driver's log: errors only. diffusers' warnings are the pipeline's own (a guidance it ignores, a size
# it changes): each distinct one reaches the log once per worker (workers/pipeline.py `warnings_once`).
# Set these yourself to see more or less.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "warning")

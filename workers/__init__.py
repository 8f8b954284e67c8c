"""One device's work, with no Ray: load a pipeline, generate shards, write outputs and manifests."""

import os

# transformers' chatter (deprecations, optional-backend notices) would repeat once per actor in the
# driver's log: errors only. diffusers' warnings are the pipeline's own (a guidance it ignores, a size
# it changes): each distinct one reaches the log once per worker (workers/pipeline/load.py `warnings_once`).
# Set these yourself to see more or less.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "warning")

import logging  # noqa: E402

# torchao tries its CUDA kernels at import and logs each one this torch cannot load; int8 weight-only
# (`--quantize ...=int8`) does not use them. diffusers warns, whenever torchao is installed, that it
# cannot register torchao 0.18's tensor classes for loading torchao-serialized checkpoints, which
# fleetgen never loads (it quantizes after loading).
logging.getLogger("torchao").setLevel(logging.ERROR)
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)  # torchao 0.18's enum registration on torch 2.13
logging.getLogger("diffusers.quantizers.torchao.torchao_quantizer").addFilter(
    lambda record: "Unable to import `torchao` Tensor objects" not in record.getMessage()
)

"""One process of a node loading a pipeline as a worker does (workers/pipeline/host_copy.py), for
tests/workers/test_host_copy.py and bench/host_copy.py: loads MODEL at DTYPE with `--host-copy MODE`, makes
one image, prints one JSON line (its host copy record, its memory by kind, the image's sha256), then holds
its pipeline, printing the line again (its memory measured anew) for each line read, until its standard
input closes, and leaves.

    python -m tests.workers.host_copy_child MODEL MODE DTYPE
"""

import hashlib
import json
import sys

import torch

from fleetgen.workers.pipeline.host_copy import HostCopy, process_memory
from fleetgen.workers.pipeline.load import load_pipeline
from fleetgen.workers.pipeline.segment import segment_key


def main(model: str, mode: str, dtype: str) -> None:
    hc = HostCopy(mode, segment_key({"model": model, "dtype": dtype}), f"{mode}-{dtype}")
    pipe = hc.load(lambda given: load_pipeline(model, getattr(torch, dtype), components=given))
    pipe.set_progress_bar_config(disable=True)
    out = pipe(
        "a red fox", num_inference_steps=2, height=32, width=32, output_type="np", generator=torch.manual_seed(3)
    )
    image = out.images
    sha = hashlib.sha256(image.tobytes()).hexdigest()
    print(json.dumps({"host_copy": hc.record(pipe), "memory": process_memory(), "sha": sha}), flush=True)
    for _ in sys.stdin:
        print(json.dumps({"host_copy": hc.record(pipe), "memory": process_memory(), "sha": sha}), flush=True)
    del pipe
    hc.close()


if __name__ == "__main__":
    main(*sys.argv[1:])

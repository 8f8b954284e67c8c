"""One process of a node loading a pipeline as a worker does (workers/pipeline/host_copy.py), for
tests/workers/test_host_copy.py and bench/host_copy.py: loads MODEL at DTYPE with `--host-copy MODE`, makes
one image, reports its record (its host copy record, its memory by kind, the image's sha256), then holds
its pipeline, reporting again (its memory measured anew) each time it is asked, until told to leave.

    python -m tests.workers.host_copy_child MODEL MODE DTYPE   # one JSON line a report; a line read: again

`forked(...)` starts the same in a process forked from one that imported torch and diffusers once (a
forkserver): the test's processes skip those seconds of imports each, and hold the same memory baseline.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import sys

import torch

from fleetgen.workers.pipeline.host_copy import HostCopy, process_memory
from fleetgen.workers.pipeline.load import load_pipeline
from fleetgen.workers.pipeline.segment import segment_key

PRELOAD = [
    "torch",
    "diffusers",
    "transformers",
    "fleetgen.workers.pipeline.load",
    "fleetgen.workers.pipeline.host_copy",
]


def loaded(model: str, mode: str, dtype: str):
    """(its host copy, the pipeline, a reporter): loaded as a worker loads, one image made."""
    hc = HostCopy(mode, segment_key({"model": model, "dtype": dtype}), f"{mode}-{dtype}")
    pipe = hc.load(lambda given: load_pipeline(model, getattr(torch, dtype), components=given))
    pipe.set_progress_bar_config(disable=True)
    out = pipe(
        "a red fox", num_inference_steps=2, height=32, width=32, output_type="np", generator=torch.manual_seed(3)
    )
    sha = hashlib.sha256(out.images.tobytes()).hexdigest()
    return hc, pipe, lambda: {"host_copy": hc.record(pipe), "memory": process_memory(), "sha": sha}


def main(model: str, mode: str, dtype: str) -> None:
    hc, pipe, report = loaded(model, mode, dtype)
    print(json.dumps(report()), flush=True)
    for _ in sys.stdin:
        print(json.dumps(report()), flush=True)
    del pipe
    hc.close()


def served(model: str, mode: str, dtype: str, shm: str, conn) -> None:
    """`main` in a forked process: reports sent on `conn`; a true value received asks again, None leaves."""
    os.environ["FLEETGEN_SHM_DIR"] = shm
    torch.set_num_threads(1)  # several such processes on this machine's cores
    hc, pipe, report = loaded(model, mode, dtype)
    conn.send(report())
    while conn.recv():
        conn.send(report())
    del pipe
    hc.close()


def forked(model: str, mode: str, dtype: str, shm: str):
    """`served` in a process forked from the forkserver (torch and diffusers imported there once):
    (the process, this side's connection)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=served, args=(model, mode, dtype, shm, theirs), daemon=True)
    proc.start()
    theirs.close()
    return proc, ours


if __name__ == "__main__":
    main(*sys.argv[1:])

"""Input images read ahead of the pipeline, against a slow store: a real S3 server (moto) behind
tests/faulty_store.py adding 200 ms to every GET, an image-to-image shard of the tiny model whose
inputs are `s3://` URLs. Reported per run: the shard's wall time, the time in pipeline calls, the
share of the worker's time outside them, and the peak RSS above the worker's start (sampled every
10 ms), with the prefetch on (the default: 16 threads, 32 images ahead) and off (each input read
when its batch starts), at two shard sizes (memory must not grow with the shard).

    python bench/inputs_prefetch.py [--rows 64,256] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import fleetgen.workers.worker

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PeakRSS:
    """Peak resident memory of this process while the block runs, sampled every 10 ms."""

    def __enter__(self):
        import psutil

        self.proc, self.stop, self.peak = psutil.Process(), threading.Event(), 0
        self.start = self.proc.memory_info().rss
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while not self.stop.wait(0.01):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.above = max(0, self.peak - self.start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="64,256")
    ap.add_argument("--delay", type=float, default=0.2)
    ap.add_argument("--json")
    args = ap.parse_args()

    from tests.faulty_store import FaultyStore, Rule

    port = _free_port()
    moto = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(3)
    store = FaultyStore(f"http://127.0.0.1:{port}", delay=args.delay).start()
    os.environ.update(
        AWS_ENDPOINT_URL=store.endpoint,
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
    )
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import s3fs
    from PIL import Image

    from fleetgen.jobs.sharding import plan_shards, read_footer, resolve_columns
    from fleetgen.workers.rows.inputs import FETCH_THREADS, PREFETCH_IMAGES, Prefetcher
    from fleetgen.workers.rows.shard import Columns
    from fleetgen.workers.spec import GenerationSettings, WorkerSpec
    from fleetgen.workers.tiny import write_tiny_model

    results = []
    try:
        fs = s3fs.S3FileSystem()
        fs.mkdir("bench-inputs")
        most = max(int(n) for n in args.rows.split(","))
        rng = np.random.default_rng(0)
        for i in range(most):
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 255, (256, 256, 3), dtype=np.uint8)).save(buf, "PNG")
            fs.pipe(f"bench-inputs/pics/{i}.png", buf.getvalue())
        store.add_rule(Rule("latency", method="GET", times=10**9))  # every GET from here on: +delay
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            model = str(write_tiny_model(tmp / "model"))
            settings = GenerationSettings(
                family="sd", steps=4, guidance=5.0, width=64, height=64, task="image-to-image", strength=0.75
            )
            for rows in (int(n) for n in args.rows.split(",")):
                path = tmp / f"in-{rows}.parquet"
                urls = [f"s3://bench-inputs/pics/{i}.png" for i in range(rows)]
                pq.write_table(
                    pa.table({"id": [str(i) for i in range(rows)], "prompt": ["x"] * rows, "input_image": urls}), path
                )
                files = [read_footer(str(path))]
                columns = resolve_columns(files, Columns.of(image="input_image"))
                for prefetch in (True, False):
                    fleetgen.workers.worker.Prefetcher = (
                        Prefetcher if prefetch else functools.partial(Prefetcher, window=0)
                    )
                    spec = WorkerSpec.of(
                        "w0",
                        model,
                        str(tmp / f"out-{rows}-{prefetch}"),
                        settings,
                        columns,
                        max_batch=4,
                        device="cpu",
                        threads=1,
                    )
                    worker = fleetgen.workers.worker.Worker(spec)
                    with PeakRSS() as rss:
                        result = worker.run_shard(plan_shards(files, 10**6)[0])
                    calls = worker.fitted.seconds
                    worker.close()
                    row = {
                        "rows": rows,
                        "prefetch": f"{FETCH_THREADS} threads, {PREFETCH_IMAGES} ahead" if prefetch else "off",
                        "ok": result.ok,
                        "shard_s": round(result.seconds, 2),
                        "pipeline_s": round(calls, 2),
                        "outside_share": round(1 - calls / result.seconds, 3),
                        "peak_rss_above_start_mib": round(rss.above / 2**20, 1),
                    }
                    print(json.dumps(row), flush=True)
                    results.append(row)
    finally:
        store.stop()
        moto.terminate()
        moto.wait(timeout=10)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

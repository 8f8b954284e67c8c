"""How fast `fleetgen verify` reads an output back, on this machine's local disk.

An output of N images (random bytes, so nothing compresses; 100 shards) is written in the `files`
and `webdataset` layouts with real manifests, then verified with and without `--deep`. Reported:
images/s and MB/s hashed. Local disk only: on an object store the request latency dominates.

    python bench/verify.py [--images 5000] [--kib 48] [--json out.json]
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHARDS = 100


def build(root: Path, images: int, size: int, fmt: str) -> None:
    from fleetgen.workers.output.layout import MANIFEST_SCHEMA

    (root / "shards").mkdir(parents=True)
    (root / "job.json").write_text("{}")
    per = images // SHARDS
    for s in range(SHARDS):
        shard = f"shard-{s:05d}"
        rows, blobs = [], []
        for i in range(per):
            data = os.urandom(size)
            rid = f"{s}-{i}"
            if fmt == "files":
                key, member = f"images/{shard}/{rid}.png", None
                (root / "images" / shard).mkdir(parents=True, exist_ok=True)
                (root / key).write_bytes(data)
            else:
                key, member = f"data/{shard}.tar", f"{rid}.png"
                blobs.append((member, data))
            rows.append(
                {
                    "id": rid,
                    "status": "ok",
                    "image": key,
                    "member": member,
                    "sha256": hashlib.sha256(data).hexdigest(),
                    "size": size,
                }
            )
        if blobs:
            (root / "data").mkdir(exist_ok=True)
            with tarfile.open(root / "data" / f"{shard}.tar", "w", format=tarfile.PAX_FORMAT) as tar:
                for name, data in blobs:
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        pq.write_table(pa.Table.from_pylist(rows, schema=MANIFEST_SCHEMA), root / "shards" / f"{shard}.parquet")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=5000)
    parser.add_argument("--kib", type=int, default=48, help="bytes per image, in KiB (a 512x512 PNG is ~400)")
    parser.add_argument("--json")
    args = parser.parse_args()
    from fleetgen.jobs.verify import verify

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in ("files", "webdataset"):
            root = Path(tmp) / fmt
            build(root, args.images, args.kib * 1024, fmt)
            for deep in (False, True):
                started = time.perf_counter()
                report = verify(str(root), deep=deep)
                seconds = time.perf_counter() - started
                assert report.clean, report.text()
                results.append(
                    {
                        "format": fmt,
                        "deep": deep,
                        "images": report.images,
                        "hashed": report.hashed,
                        "seconds": round(seconds, 3),
                        "images_per_s": round(report.images / seconds),
                        "hashed_mb_per_s": round(report.bytes_read / seconds / 1e6, 1),
                    }
                )
                print(json.dumps(results[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

"""What a shard costs to read when its row group is big: one 1 Mi-row group (pyarrow's default
row-group size, as a big prompt file has it), 256-row shards (4,096 of them in the group).

  whole group   what a shard did before: read the whole row group, then slice its rows
  streamed      `workers.shard.read_shard`: the group's pages streamed from its start, stopping at
                the shard's last row (pyarrow has no row-range read: pages before the shard are
                still decoded, pages after it never fetched)

Seconds and bytes fetched per shard, averaged over shards spread evenly over the group, in one run.

    python bench/shard_read.py [--rows 1048576] [--samples 64]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fleetgen.workers.rows.shard as shard_module  # noqa: E402
from fleetgen.jobs.sharding import plan_shards, read_footer  # noqa: E402
from fleetgen.workers.rows.shard import Columns  # noqa: E402


class Counting:
    """A file that counts the bytes read through it."""

    def __init__(self, f):
        self.f, self.bytes = f, 0

    def read(self, n=-1):
        data = self.f.read(n)
        self.bytes += len(data)
        return data

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def counting(url_to_fs, opened: list):
    """`url_to_fs` whose filesystems open `Counting` files, each appended to `opened`."""

    def wrapped(url):
        fs, path = url_to_fs(url)

        class FS:
            def open(self, p, mode):
                opened.append(Counting(fs.open(p, mode)))
                return opened[-1]

        return FS(), path

    return wrapped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1 << 20)
    parser.add_argument("--samples", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "p.parquet"
        ids = np.arange(args.rows).astype(str)
        pq.write_table(
            pa.table({"id": ids, "prompt": np.char.add("a photo of a thing, number ", ids)}),
            path,
            row_group_size=args.rows,
        )
        shards = plan_shards([read_footer(str(path))], 256)
        picked = shards[:: max(1, len(shards) // args.samples)]
        columns = Columns.of(seed=None, negative_prompt=None)
        opened = []
        real = shard_module.url_to_fs
        counting_fs = shard_module.url_to_fs = counting(real, opened)
        result = {"rows_in_group": args.rows, "file_bytes": path.stat().st_size, "shards_sampled": len(picked)}
        for name in ("whole_group", "streamed"):
            opened.clear()
            started = time.perf_counter()
            for shard in picked:
                if name == "streamed":
                    shard_module.read_shard(shard, columns)
                else:
                    fs, p = counting_fs(str(path))
                    with fs.open(p, "rb") as f:
                        pq.ParquetFile(f).read_row_group(0, columns=columns.present()).slice(shard.offset, shard.length)
            seconds = (time.perf_counter() - started) / len(picked)
            result[name] = {
                "seconds_per_shard": round(seconds, 4),
                "bytes_per_shard": round(sum(c.bytes for c in opened) / len(picked)),
            }
        shard_module.url_to_fs = real
        result["streamed_over_whole"] = {
            k: round(result["streamed"][k] / result["whole_group"][k], 3)
            for k in ("seconds_per_shard", "bytes_per_shard")
        }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

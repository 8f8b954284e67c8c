"""One worker process of a node, for tests/workers/test_host_copy.py: makes a prompt file as one shard
with `--host-copy MODE`, prints one JSON line (its host copy record, its private memory after the
shard, its images' sha256), then holds its pipeline until its standard input closes, and closes.

    python -m tests.workers.host_copy_child MODEL MODE OUT PROMPTS DTYPE
"""

import json
import sys

from fleetgen.workers.pipeline.host_copy import process_memory
from tests.conftest import fast_settings, run_one_shard


def main(model: str, mode: str, out: str, prompts: str, dtype: str) -> None:
    worker, rows = run_one_shard(model, out, prompts, fast_settings(), host_copy=mode, dtype=dtype)
    record = worker.fitted.host_copy.record(worker.fitted.pipe)
    shas = {i: r["sha256"] for i, r in rows.items()}
    print(json.dumps({"host_copy": record, "memory": process_memory(), "shas": shas}), flush=True)
    sys.stdin.read()
    worker.close()


if __name__ == "__main__":
    main(*sys.argv[1:])

"""A `fleetgen run` driver's own CPU, one source tree against another, on one local Ray.

The driver of a job (the process `fleetgen run` or `ray job submit` starts) reads the input's
footers, plans, hands out shards and writes the job's records; the workers are what run torch and
diffusers. Here each run is `python -m fleetgen run` started from a source tree (it imports that
tree's rooms, fleetgen/__init__.py), joining a Ray head this script starts on 127.0.0.1, making a
one-shard job of the tiny model with one worker; its CPU is the process's own (`os.wait4`), its
worker's not counted. The trees alternate (A, B, A, B, ...) and the ratio is taken per pair, so the
machine's noise hits both. A tree is any checkout: `git worktree add /tmp/old REV`.

    python bench/driver_cpu.py --tree /tmp/old --tree . [--pairs 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests/stores.py's free_port


def start_head(temp: str) -> tuple[subprocess.Popen, str]:
    """`ray start --head --block` on loopback, in `temp`; its GCS address once it answers."""
    from tests.stores import free_port

    port = free_port()
    ray = str(Path(sys.executable).parent / "ray")
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "HOME": temp}
    head = subprocess.Popen(
        [ray, "start", "--head", "--block", "--port", str(port), "--node-ip-address", "127.0.0.1",
         "--num-cpus", "2", "--include-dashboard", "false", "--temp-dir", temp, "--disable-usage-stats"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while subprocess.run([ray, "status", "--address", f"127.0.0.1:{port}"], env=env, capture_output=True).returncode:
        if head.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("the Ray head did not come up")
        time.sleep(1)
    return head, f"127.0.0.1:{port}"


def driver_cpu(tree: Path, address: str, model: str, prompts: str, out: str, home: str) -> float:
    """CPU seconds (user + system) of one `python -m fleetgen run` started in `tree`."""
    env = {**os.environ, "RAY_ADDRESS": address, "HOME": home, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    args = ["--input", prompts, "--output", out, "--model", model, "--steps", "2", "--width", "32", "--height", "32",
            "--device", "cpu", "--workers", "1"]  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "fleetgen", "run", *args],
        cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    _, status, usage = os.wait4(proc.pid, 0)
    err = proc.stderr.read()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"`fleetgen run` in {tree} failed:\n{err[-3000:]}")
    return usage.ru_utime + usage.ru_stime


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", action="append", required=True, type=Path, help="a source tree (twice)")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if len(args.tree) != 2:
        parser.error("give two trees: --tree A --tree B")
    import pyarrow as pa
    import pyarrow.parquet as pq

    from fleetgen.workers.tiny import write_tiny_model

    temp = tempfile.mkdtemp(prefix="rayd", dir="/tmp")  # short: Ray's socket paths are length-limited
    head = None
    try:
        model = str(write_tiny_model(Path(temp) / "tiny"))
        prompts = str(Path(temp) / "p.parquet")
        pq.write_table(pa.table({"prompt": ["a red fox", "an owl"]}), prompts)
        head, address = start_head(temp)
        trees = [t.resolve() for t in args.tree]
        seconds: dict[str, list[float]] = {str(t): [] for t in trees}
        driver_cpu(trees[1], address, model, prompts, f"{temp}/warmup", temp)  # the page cache, Ray's first job
        for i in range(args.pairs):
            for tree in trees:
                cpu = driver_cpu(
                    tree, address, model, prompts, f"{temp}/out-{i}-{len(seconds[str(tree)])}-{tree.name}", temp
                )
                seconds[str(tree)].append(cpu)
                print(f"pair {i + 1}: {tree}: {cpu:.2f} s", flush=True)
        a, b = (seconds[str(t)] for t in trees)
        ratios = [y / x for x, y in zip(a, b, strict=True)]
        result = {
            "driver_cpu_seconds": {str(t): [round(s, 2) for s in seconds[str(t)]] for t in trees},
            "median": {str(t): round(statistics.median(seconds[str(t)]), 2) for t in trees},
            "ratio_b_over_a_per_pair": [round(r, 3) for r in ratios],
        }
        print(json.dumps(result, indent=1))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
    finally:
        if head is not None:  # the head and every process it started, by pid
            import psutil

            family = psutil.Process(head.pid).children(recursive=True)
            head.terminate()
            try:
                head.wait(timeout=60)
            except subprocess.TimeoutExpired:
                head.kill()
            for p in family:
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass
        shutil.rmtree(temp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

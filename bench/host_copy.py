"""Host RAM per node with one copy of the weights per node (`--host-copy node`) against a copy per worker.

    python bench/host_copy.py                  # predicted: shipped architectures, nodes of 4 and 8 GPUs
    python bench/host_copy.py --measure        # and measured on this CPU: worker processes of one node

Predicted: `fleetgen plan`'s own numbers (jobs/planning.py `plan_rows`), each architecture at 1024² (a video
one at its own frames) on 24 GB and 80 GB GPUs, with RAM enough that no plan is bound by it (4 TiB). The
table gives the RAM a node needs: steady (the node's copy once plus each worker's own, or each worker's
pinned copies) and while loading (the first worker writing the node's copy beside its load, or every
worker loading its own at once).

Measured: a process loading as a worker does with a copy of its own, then four at once mapping the node's
copy, each making an image with the 85 M-parameter built-in model loaded at bfloat16 from its float32 files
(tests/workers/host_copy_child.py); each one's own memory (RssAnon) and the shared memory it maps
(RssShmem), and the node's sum.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fleetgen.jobs.planning import NodeShare, RowsAsk, plan_rows, plan_workload  # noqa: E402
from fleetgen.offload.architectures import NAMES  # noqa: E402
from fleetgen.units import format_size  # noqa: E402

HOST = 4 << 40  # RAM enough that no plan is bound by it: what a node needs is the answer


def predicted() -> list[dict]:
    from fleetgen.jobs.planning import PlanRequest

    out = []
    for name in NAMES:
        request = PlanRequest.of(name, budgets=("24GiB",))
        work, family = plan_workload(request)
        for gpu in ("24GiB", "80GiB"):
            for n in (4, 8):
                row = {"model": name, "gpu": gpu, "workers": n}
                for mode in ("node", "worker"):
                    summary, rows = plan_rows(RowsAsk(name, (gpu,), HOST, family.dtype, work, node=NodeShare(n, mode)))
                    r = rows[0]
                    if "error" in r:
                        row[mode] = None
                        continue
                    node = r["node"]
                    row[mode] = {"steady": node["host_bytes"], "loading": node["load_peak_bytes"]}
                row["weights"] = summary["load_host_bytes"]
                out.append(row)
    return out


def measured(workers: int = 4) -> dict:
    """Processes of this node loading as workers do: one with a copy of its own, then `workers` at once
    with the node's (tests/workers/host_copy_child.py)."""
    from fleetgen.cli import main as cli
    from tests.workers.test_host_copy import report

    tmp = Path(tempfile.mkdtemp(prefix="fleetgen-host-copy-bench-"))
    shm = Path(tempfile.mkdtemp(prefix="fleetgen-host-copy-bench-", dir="/dev/shm"))
    model = tmp / "model"
    cli(["tiny-model", "--size", "small", str(model)])
    env = {**os.environ, "FLEETGEN_SHM_DIR": str(shm)}
    seen = {}
    for mode, n in (("worker", 1), ("node", workers)):
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "tests.workers.host_copy_child", str(model), mode, "bfloat16"],
                cwd=ROOT,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for _ in range(n)
        ]
        seen[mode] = [report(p) for p in procs]
        for p in procs:
            p.stdin.close()
            p.wait(timeout=300)
    left = list(shm.iterdir())
    shm.rmdir()
    weights = seen["node"][0]["host_copy"]["shared_bytes"]
    return {"weights": weights, "left_in_shm": len(left), **seen}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--measure", action="store_true", help="also measure worker processes on this CPU")
    args = ap.parse_args()
    print("model               gpu    gpus  weights    node: steady / loading     per worker: steady / loading")
    for r in predicted():

        def cell(v):
            return (
                f"{format_size(v['steady']):>10} / {format_size(v['loading']):>10}" if v else "     nothing fits     "
            )

        print(
            f"{r['model']:<19} {r['gpu']:<6} {r['workers']:>4}  {format_size(r['weights']):>9}  "
            f"{cell(r['node'])}    {cell(r['worker'])}"
        )
    if args.measure:
        m = measured()
        mib = 2**20
        for mode in ("worker", "node"):
            anon = [r["memory"]["anon_bytes"] // mib for r in m[mode]]
            shm = [r["memory"].get("shmem_bytes", 0) // mib for r in m[mode]]
            total = sum(r["memory"]["anon_bytes"] for r in m[mode]) + (m["weights"] if mode == "node" else 0)
            print(
                f"measured, {len(anon)} workers, host copy per {mode}: own memory (RssAnon) {anon} MiB, "
                f"shared mapped {shm} MiB; the node's sum {total // mib} MiB"
            )
        print(f"weights at bfloat16: {m['weights'] // mib} MiB; left in the shared directory after: {m['left_in_shm']}")


if __name__ == "__main__":
    main()

"""No node's copy of the weights outlives its last live user (workers/pipeline/segment.py): a worker that
leaves removes the copy it was the last user of, but a SIGKILLed worker, or an actor that Ray Data or
`ray.shutdown()` ends without its exit handlers, leaves its files in the node's shared memory. So the
driver of a job at its end, and a Ray Data stage's caller when its dataset is done or it exits, reclaim
this user's segments that no live process uses on every node of the cluster (a task pinned to each),
or on this node where Ray is gone."""

from __future__ import annotations

import atexit
import time

import ray

RECLAIM_TIMEOUT = 30.0  # seconds the driver waits for the nodes' answers (a node lost meanwhile answers never)
SETTLE = 5.0  # seconds a local reclaim retries at exit while ended workers' locks are still being dropped


@ray.remote(num_cpus=0, max_retries=0)
def _reclaim_here() -> list[str]:
    from fleetgen.workers.pipeline.user_dir import reclaim  # no torch: a task's process stays light

    return reclaim()


def reclaim_nodes(timeout: float = RECLAIM_TIMEOUT) -> int:
    """This user's orphaned segments removed on every live node (none where Ray is not connected): how many."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if not ray.is_initialized():
        return 0
    refs = [
        _reclaim_here.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote()
        for n in ray.nodes()
        if n.get("Alive")
    ]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
    removed = 0
    for ref in ready:
        try:
            removed += len(ray.get(ref))
        except ray.exceptions.RayError:  # a node that went away: its memory went with it
            pass
    return removed


def reclaim_local(settle: float = SETTLE) -> int:
    """This user's orphaned segments removed on this node, retrying for `settle` seconds while some
    remain (workers that Ray is ending drop their locks as their processes exit): how many."""
    from fleetgen.workers.pipeline.user_dir import PREFIX, Unavailable, UserDir, reclaim

    removed, deadline = 0, time.monotonic() + settle
    while True:
        removed += len(reclaim())
        try:
            home = UserDir()
            left = [n for n in home.names() if n.startswith(PREFIX) and n.endswith(".users")]
            home.close()
        except Unavailable:
            return removed
        if not left or time.monotonic() >= deadline:
            return removed
        time.sleep(0.2)


_at_exit = False


def reclaim_at_exit() -> None:
    """Once per process: at its exit, reclaim on every node while Ray is connected, and on this one."""
    global _at_exit
    if not _at_exit:
        _at_exit = True
        atexit.register(_exit)


def _exit() -> None:
    try:
        reclaim_nodes(timeout=5.0)
    except Exception:  # noqa: BLE001, S110 - Ray going down around us: the local reclaim still runs
        pass
    reclaim_local()

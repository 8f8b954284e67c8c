"""The pool on Ray's own autoscaler (its fake node provider: a real GCS, raylets and autoscaler on
this machine, each "node" a local raylet with the resources its type declares), and the fleet's
edges on the local Ray: a worker that fits nothing, demand that cannot be placed, sizing.

The head has no GPU and no CPU; two worker node types declare `GPU: 1` with `min_workers: 0`.
Jobs run with `--device cpu --gpus-per-worker 1`: scheduled by the GPU resource, computing on CPU
(Ray honours a GPU declared on a CPU-only node, while torch sees no CUDA device).
"""

import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pyarrow.parquet as pq
import pytest

from fleetgen.cluster import ClusterShape, size_fleet
from fleetgen.jobs.config import JobConfig, validate
from fleetgen.jobs.driver import run_job
from fleetgen.jobs.status import job_state, status_text
from fleetgen.workers.spec import GenerationSettings
from tests.conftest import FAST, _free_port, fast_settings, lag, run_one_shard, start_driver, stop_tree, write_prompts

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
NODE = {"CPU": 1, "GPU": 1}
# A node joining by hand, on loopback, the way the fake provider starts its nodes (`ray start
# --address` would rewrite 127.0.0.1 into the machine's outward address).
JOIN_NODE = """
import json, sys, time
from ray._private.node import Node
from ray._private.parameter import RayParams
params = RayParams(node_ip_address="127.0.0.1", gcs_address=sys.argv[1], redis_address=sys.argv[1], num_cpus=1,
                   num_gpus=1, resources=json.loads(sys.argv[2]), min_worker_port=0, max_worker_port=0,
                   dashboard_agent_listen_port=0)
Node(params, head=False, shutdown_at_exit=True, spawn_reaper=False)
print("joined", flush=True)
while True:
    time.sleep(1)
"""
N_ELASTIC = 40  # rows, in 20 shards: with the store's lag (`slow_s3`), ~30 s for a node to join and die mid-job


def _env(**extra) -> dict:
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled", **extra}
    env.pop("RAY_ADDRESS", None)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


def _cluster_config(port: int) -> dict:
    worker_types = {
        name: {"resources": {**NODE, f"fleetgen-gpu:{name}": 1}, "node_config": {}, "min_workers": 0, "max_workers": 1}
        for name in ("fake-a", "fake-b")
    }
    return {
        "cluster_name": "fleetgen-test",
        "max_workers": 2,
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": 0.1,
        "provider": {
            "type": "fake_multinode",
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
            "gcs_address": f"127.0.0.1:{port}",
        },
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": 0}, "node_config": {}, "max_workers": 0},
            **worker_types,
        },
        "head_node_type": "ray.head.default",
        "auth": {},
        "docker": {},
        "file_mounts": {},
        "cluster_synced_files": [],
        "initialization_commands": [],
        "setup_commands": [],
        "head_setup_commands": [],
        "worker_setup_commands": [],
        "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
        "rsync_exclude": [],
        "rsync_filter": [],
    }


@pytest.fixture(scope="module")
def autoscaling_head(_stores_env):
    """A head with Ray's autoscaler and fake node provider, on loopback; stopped with every node
    it started when the module ends. Its nodes' workers find the test stores as this process does."""
    port = _free_port()
    temp = tempfile.mkdtemp(prefix="rayf", dir="/tmp")  # short: Ray's socket paths are length-limited
    config = Path(temp) / "fleetgen.cluster.json"
    config.write_text(json.dumps(_cluster_config(port)))
    cmd = [
        str(BIN / "ray"),
        "start",
        "--head",
        "--block",
        f"--autoscaling-config={config}",
        "--port",
        str(port),
        "--node-ip-address",
        "127.0.0.1",
        "--num-cpus",
        "0",
        "--num-gpus",
        "0",
        "--temp-dir",
        temp,
        "--include-dashboard",
        "false",
        "--disable-usage-stats",
    ]
    # Node deaths noticed within ~2 s instead of Ray's default ~30 s.
    env = _env(
        TMPDIR=temp,  # what its killed processes leave in the temp dir, removed with it
        AUTOSCALER_UPDATE_INTERVAL_S="1",
        RAY_FAKE_CLUSTER="1",
        RAY_health_check_period_ms="500",
        RAY_health_check_failure_threshold="3",
        RAY_health_check_timeout_ms="500",
    )
    log = open(Path(temp) / "head.log", "w")
    head = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        # the GCS port first (cheap), then `ray status` (a process importing Ray) until the cluster answers
        while not _listening(port):
            assert head.poll() is None, (Path(temp) / "head.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the autoscaling head did not come up"
            time.sleep(0.2)
        while (
            subprocess.run([str(BIN / "ray"), "status", "--address", address], env=env, capture_output=True).returncode
            != 0
        ):
            assert head.poll() is None, (Path(temp) / "head.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the autoscaling head did not come up"
            time.sleep(1)
        yield address, env
    finally:
        stop_tree(head)
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def _driver(args: list[str], address: str, env: dict, log: Path) -> subprocess.Popen:
    return start_driver(["--ray-address", address, *args], env, log)


def _wait(what, check, proc: subprocess.Popen, log: Path, timeout: float = 180):
    deadline = time.monotonic() + timeout
    while not (value := check()):
        more = "".join(p.read_text()[-3000:] for p in log.parent.glob("spot.log"))
        assert proc.poll() is None, f"driver ended before {what}:\n{log.read_text()[-4000:]}\n{more}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{log.read_text()[-4000:]}"
        time.sleep(0.3)
    return value


def _fleet(fs, where: str) -> dict:
    """fleet.json of the job at `where` (its bucket and prefix on the test S3), read around the proxy's lag."""
    fs.invalidate_cache()
    try:
        return json.loads(fs.cat(f"{where}/fleet.json"))["workers"]
    except (FileNotFoundError, ValueError):
        return {}


def _manifest_rows(fs, where: str) -> list[dict]:
    return pq.read_table(f"{where}/shards", filesystem=fs, columns=["id", "status", "sha256", "worker"]).to_pylist()


def _shards_of(rows: list[dict], worker: str) -> set[int]:
    """The shards (of 2 rows) whose rows `worker` made: a row's id is `<file>-<row>`."""
    return {int(r["id"].split("-")[1]) // 2 for r in rows if r["worker"] == worker}


@pytest.mark.slow
def test_autoscaler_starts_gpu_nodes_a_joining_node_gets_a_worker_a_lost_node_loses_nothing(
    autoscaling_head, tiny_model, tmp_path, slow_s3
):
    """No GPU node is up when the job starts: its pending workers make the autoscaler start both
    node types; a node joined by hand mid-job (a replacement spot node) gets a worker; killing that
    node's raylet mid-job loses nothing: every row once, the same images as a clean run. The output is
    on S3 with every answer late (`slow_s3`): the job lasts while the nodes come and go, as a job on a
    GPU does, without its workers taking the CPU the rest of the suite needs."""
    address, env = autoscaling_head
    prompts = write_prompts(tmp_path / "p.parquet", [f"elastic {i}" for i in range(N_ELASTIC)])
    out = slow_s3.location("elastic")
    fs, where = slow_s3.filesystem(direct=True), out.removeprefix("s3://")
    common = [
        "--input",
        str(prompts),
        "--model",
        tiny_model,
        *(f"--{k}={v}" for k, v in FAST.items() if k not in ("device", "workers")),
        "--rows-per-shard",
        "2",
        "--max-batch",
        "2",
        "--device",
        "cpu",
    ]
    log = tmp_path / "driver.log"
    driver = _driver(
        [*common, "--output", out, "--gpus-per-worker", "1", "--max-workers", "3", "--placement-timeout", "120"],
        address,
        env,
        log,
    )
    spot = None
    try:
        # The fake GPU node types are started by the autoscaler for the pending workers.
        _wait(
            "a worker placed on an autoscaled node",
            lambda: {w.get("gpu_type") for w in _fleet(fs, where).values()} & {"fake-a", "fake-b"},
            driver,
            log,
        )
        # A node joins mid-job: the third pending worker is placed on it.
        spot = subprocess.Popen(
            [sys.executable, "-c", JOIN_NODE, address, json.dumps({"fleetgen-gpu:fake-spot": 1})],
            env=env,
            stdout=open(tmp_path / "spot.log", "w"),
            stderr=subprocess.STDOUT,
        )
        name = _wait(
            "a worker on the joining node",
            lambda: next(
                (n for n, w in _fleet(fs, where).items() if w.get("gpu_type") == "fake-spot" and w["state"] == "ready"),
                None,
            ),
            driver,
            log,
        )
        # The node is lost mid-job (preempted) as soon as its worker is ready, so that the job still has
        # shards for it (waiting for its first commit, a slow machine once saw the job end first, the
        # dead worker idle and never asked again): its raylet dies, taking the worker with it.
        raylet = next(p for p in psutil.Process(spot.pid).children(recursive=True) if p.name() == "raylet")
        raylet.send_signal(signal.SIGKILL)
        _wait(
            f"{name} lost",
            lambda: _fleet(fs, where).get(name, {}).get("state") in ("unreachable", "restarting", "lost"),
            driver,
            log,
        )
        assert driver.wait(timeout=240) == 0, log.read_text()[-4000:]
        lag(slow_s3.proxy, 0)  # the job is done: what follows reads it at the store's own speed
    finally:
        if driver.poll() is None:
            driver.kill()
        if spot is not None:
            stop_tree(spot)
    text = log.read_text()
    assert "up to 3 worker(s) on GPU, each asking GPU 1, CPU 1" in text
    assert "[fake-a]" in text and "[fake-b]" in text and "[fake-spot]" in text
    assert f"{name} lost" in text and "released: nothing left to do" in text

    rows = _manifest_rows(fs, where)
    assert sorted(r["id"] for r in rows) == sorted({r["id"] for r in rows}) and len(rows) == N_ELASTIC
    assert all(r["status"] == "ok" for r in rows)
    assert len([p for p in fs.find(f"{where}/images") if p.endswith(".png")]) == N_ELASTIC
    summary = json.loads(fs.cat(f"{where}/summary.json"))
    assert summary["complete"] and summary["exit_code"] == 0
    # The table shows each worker where it ran last: the lost node's worker on it, or, restarted by Ray
    # on an autoscaled node before the job ended, there with a second start.
    table = {w["worker"]: w for w in summary["workers"]}
    assert {"fake-a", "fake-b"} <= {w["gpu_type"] for w in table.values()} <= {"fake-a", "fake-b", "fake-spot"}
    assert table[name]["gpu_type"] == "fake-spot" or table[name]["starts"] >= 2, table[name]
    status = status_text(job_state(out))
    assert "fleet:" in status and "lost" in status and "released" in status

    # The same images as a clean run, checked on the shards that matter (the lost node's, and the one
    # it was running if the log names it) and every fourth, made in this process by one worker with
    # one thread, as each of the job's has, in the same batches.
    lost = {int(i) for i in re.findall(rf"{name} unreachable while running shard-(\d+)", text)}
    picked = sorted(set(range(0, N_ELASTIC // 2, 4)) | lost | _shards_of(rows, name))
    worker, clean = run_one_shard(
        tiny_model, tmp_path / "clean", prompts, fast_settings(), rows=2, shards=picked, max_batch=2, threads=1
    )
    worker.close()
    made = {r["id"]: r["sha256"] for r in rows}
    assert len(clean) == 2 * len(picked) and {k: made[k] for k in clean} == {k: r["sha256"] for k, r in clean.items()}


def test_demand_that_cannot_be_placed_ends_the_job_naming_the_resource(autoscaling_head, tiny_model, tmp_path):
    """A worker asking for more host memory than any node type has: the autoscaler can start
    nothing for it; the job ends after `--placement-timeout` with exit 2, having written only job.json."""
    address, env = autoscaling_head
    prompts = write_prompts(tmp_path / "p.parquet", [f"p{i}" for i in range(4)])
    out = tmp_path / "out"
    log = tmp_path / "driver.log"
    started = time.monotonic()
    driver = _driver(
        [
            "--input",
            str(prompts),
            "--output",
            str(out),
            "--model",
            tiny_model,
            "--device",
            "cpu",
            "--gpus-per-worker",
            "1",
            "--host-memory",
            "4TiB",
            "--placement-timeout",
            "8",
        ],
        address,
        env,
        log,
    )
    assert driver.wait(timeout=120) == 2, log.read_text()[-3000:]
    assert time.monotonic() - started < 60
    text = log.read_text()
    assert "No worker could be placed in 8 s" in text and "GPU 1, CPU 1, memory 4096.0 GiB" in text, text
    assert "node(s): 127.0.0.1: " in text  # the nodes' sizes are named
    assert sorted(p.name for p in out.iterdir()) == ["job.json"]


def test_a_worker_that_fits_nothing_is_reported_and_the_job_goes_on(ray_cluster, tiny_model, tmp_path):
    # Enough shards that the worker that can run is still at them when the other one fails to start
    # (with only two, it once finished first: the loading worker was released, its failure unseen).
    prompts = write_prompts(tmp_path / "p.parquet", [f"fit {i}" for i in range(18)])
    log = io.StringIO()
    config = validate(
        JobConfig.of(
            input=str(prompts),
            output=str(tmp_path / "out"),
            model=tiny_model,
            **{**FAST, "rows_per_shard": 3, "worker_memory": "3MiB,1GiB", "workers": None},
            host_copy="worker",  # both load at once (with the node's copy the second waits for the first's)
        )
    )
    summary = run_job(config, progress_stream=log, progress_interval=0)
    assert summary.complete and summary.images_ok == 18
    lines = [line for line in log.getvalue().splitlines() if "cannot run" in line]
    assert len(lines) == 1 and lines[0].startswith("[fleetgen] w0") and "the job goes on without it" in lines[0]
    assert "OffloadError" in lines[0] and "3.0 MiB" in lines[0], lines  # why, and the budget it had
    assert "Traceback" not in log.getvalue()
    written = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert [w["worker"] for w in written["workers_failed"]] == ["w0"]
    assert {w["worker"]: w["images"] for w in written["workers"]} == {"w0": 0, "w1": 18}
    assert "worker w0 could not run: OffloadError" in status_text(job_state(str(tmp_path / "out")))


def test_fleet_sizing():
    local_cpu = ClusterShape(cpus=4, gpus=0, started_here=True, on_cluster=False)
    cluster = ClusterShape(cpus=0, gpus=0, started_here=False, on_cluster=True)
    one_gpu = ClusterShape(cpus=16, gpus=1, started_here=True, on_cluster=False)
    kw = {"cpu_threads": 1, "max_workers": None, "budgets": 0, "host_memory": None, "shards": 500}
    # A laptop: CPU workers, one per CPU.
    assert size_fleet(local_cpu, device="auto", gpus_per_worker=None, **kw).options == {"num_cpus": 1}
    assert size_fleet(local_cpu, device="auto", gpus_per_worker=None, **kw).max_workers == 4
    # A cluster with no GPU node up yet: GPU workers all the same, one per shard up to the cap.
    fleet = size_fleet(cluster, device="auto", gpus_per_worker=None, **kw)
    assert fleet.gpu and fleet.options == {"num_gpus": 1, "num_cpus": 1} and fleet.max_workers == 500
    assert size_fleet(cluster, device="auto", gpus_per_worker=None, **{**kw, "shards": 5000}).max_workers == 1000
    # ... and CPU workers there only when asked.
    assert not size_fleet(cluster, device="cpu", gpus_per_worker=None, **kw).gpu
    # Scheduled by GPU, computing on CPU with fixed threads.
    fleet = size_fleet(cluster, device="cpu", gpus_per_worker=1, **{**kw, "cpu_threads": 2})
    assert fleet.options == {"num_gpus": 1, "num_cpus": 2} and fleet.threads == 2
    # `--worker-memory` with four budgets on one GPU: a quarter GPU each, so all four run.
    fleet = size_fleet(one_gpu, device="auto", gpus_per_worker=None, **{**kw, "budgets": 4})
    assert fleet.options["num_gpus"] == 0.25 and fleet.max_workers == 4
    assert size_fleet(one_gpu, device="auto", gpus_per_worker=0.5, **kw).max_workers == 2
    # Never more workers than shards; an explicit host budget is reserved as Ray memory.
    fleet = size_fleet(local_cpu, device="auto", gpus_per_worker=None, **{**kw, "shards": 2, "host_memory": 2**30})
    assert fleet.max_workers == 2 and fleet.options["memory"] == 2**30


def test_budgets_follow_the_workers_share_of_its_node():
    from fleetgen.cluster.actor import HOST_SHARE, fit_to_share
    from fleetgen.workers.rows.shard import Columns
    from fleetgen.workers.spec import WorkerSpec

    spec = WorkerSpec.of("w0", "m", "out", GenerationSettings(family="sd", task="text-to-image"), Columns())
    node = {"node_memory": 64 * 2**30, "node_gpus": 4, "node_cpus": 16}
    # One GPU of four: a quarter of the node's RAM; a whole GPU's memory is the worker's to measure.
    fitted = fit_to_share(spec, {"num_gpus": 1, "num_cpus": 1}, node, device_total=80 * 2**30)
    assert fitted.fit.host_memory == int(16 * 2**30 * HOST_SHARE) and fitted.fit.gpu_memory is None
    # Half a GPU: half the device's memory, and an eighth of the node's RAM.
    fitted = fit_to_share(spec, {"num_gpus": 0.5, "num_cpus": 1}, node, device_total=80 * 2**30)
    assert fitted.fit.gpu_memory == 40 * 2**30 and fitted.fit.host_memory == int(8 * 2**30 * HOST_SHARE)
    # CPU workers split the node by CPUs; budgets given explicitly are kept.
    assert fit_to_share(spec, {"num_cpus": 4}, node, None).fit.host_memory == int(16 * 2**30 * HOST_SHARE)
    given = WorkerSpec.of(
        "w0",
        "m",
        "out",
        GenerationSettings(family="sd", task="text-to-image"),
        Columns(),
        gpu_memory=2**30,
        host_memory=2**30,
    )
    assert fit_to_share(given, {"num_gpus": 0.5}, node, 80 * 2**30) == given


@pytest.mark.cluster
def test_run_with_no_address_starts_its_own_ray_even_with_a_stale_cluster_file(tmp_path):
    """`ray_current_cluster` left by a dead `ray start` must not be joined (it used to hang)."""
    temp = Path(tempfile.mkdtemp(prefix="rays", dir="/tmp"))
    (temp / "ray").mkdir()
    (temp / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{_free_port()}")  # nothing listens there
    code = (
        "import ray, time; from fleetgen.cluster import connect, disconnect; t = time.monotonic(); "
        "shape = connect(); print('started', shape.started_here, round(time.monotonic() - t)); disconnect()"
    )
    env = _env(RAY_TMPDIR=str(temp))
    try:
        done = subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
        )
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    assert done.returncode == 0 and "started True" in done.stdout, done.stdout + done.stderr[-3000:]

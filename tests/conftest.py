"""Shared fixtures: the tiny model, prompt files, a real S3 server on loopback, one local Ray.

Markers say what a test starts, so `make test-fast` can leave the costly ones out:
- `ray`: uses the session's local Ray (derived: the test asks for `ray_cluster`);
- `cluster`: starts Ray heads or autoscalers of its own (derived from `ray_head` and
  `autoscaling_head`, or marked where a test starts one in a subprocess);
- `chaos`: whole jobs under injected faults; `slow`: over ~15 s for another reason (marked).
A test that starts an in-process Ray without asking for `ray_cluster` fails (`_marked_for_ray`).
`make test` runs two pytest workers: the tests with Ray heads of their own run on one of them, one at
a time, and the tests on the session's Ray on one, one at a time, on one session Ray
(`pytest_collection_modifyitems`)."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

# A Ray head started here binds to loopback (see cluster/connect.py); set before Ray is imported.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# Ray starts its workers at nice 15 (its `worker_niceness`), below the raylet's own processes. Here the
# other load is the other pytest worker, at nice 0: beside two busy processes a test's Ray worker got a
# ~30 times smaller share of a core than each, and its start (seconds of imports) took 77 s (measured;
# BENCHMARKS.md). The tests' Rays start their workers at nice 0, as `ray job submit` does its drivers.
os.environ.setdefault("RAY_worker_niceness", "0")
# Ray's log monitor looks for new log files every 0.1 s while a session has fewer than this many, else
# every 0.5 s: a session that has started 40 workers spends 3.4 % of a core on it, 1.7 % at 0.5 s
# (measured). The tests' Rays look every 0.5 s: a new worker's first lines reach its driver up to
# 0.4 s later, and every line still does.
os.environ.setdefault("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "0")
HUB_PORT = 0  # the port of the tests' hub: set in pytest_configure
_HF_HOME: str | None = None
_SHM: str | None = None  # FLEETGEN_SHM_DIR of this pytest process: set in pytest_configure


def pytest_configure(config):
    """The hub of the tests is tests/hub_server.py on a loopback port chosen here, with a cache of its
    own (never the user's), per pytest process. Set before the test modules are imported (anything
    importing huggingface_hub reads HF_ENDPOINT then) and before any Ray starts (its workers inherit
    them); files come over plain HTTP. Here, not at import: a Ray worker that imports a test module
    (a function of it sent to an actor) keeps the hub of the process that started it, and makes no
    folder that nobody removes (a killed worker runs no exit handlers)."""
    global HUB_PORT, _HF_HOME, _SHM
    _HF_HOME = tempfile.mkdtemp(prefix="fleetgen-hf-")
    # the node-shared host copies (workers/pipeline/host_copy.py) of this pytest process and the Ray
    # workers it starts: a folder of their own, in /dev/shm where there is one, removed at the end
    shm = Path("/dev/shm")
    _SHM = tempfile.mkdtemp(prefix="fleetgen-tests-", dir=shm if shm.is_dir() else None)
    os.environ["FLEETGEN_SHM_DIR"] = _SHM
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        HUB_PORT = s.getsockname()[1]
    os.environ.update(HF_HOME=_HF_HOME, HF_ENDPOINT=f"http://127.0.0.1:{HUB_PORT}", HF_HUB_DISABLE_XET="1")


def pytest_unconfigure(config):
    if _HF_HOME:
        shutil.rmtree(_HF_HOME, ignore_errors=True)
    if _SHM:
        shutil.rmtree(_SHM, ignore_errors=True)
    if _saw_full_collection in gc.callbacks:
        gc.callbacks.remove(_saw_full_collection)


# Python's cyclic collector in a pytest process. The tests import torch, diffusers and transformers and
# build hundreds of small pipelines: a pytest worker's heap grows to ~700 k objects, and each full
# collection (Python runs one whenever the objects kept since the last one reach a quarter of the rest)
# walks all of it, ~0.3 s, 30-40 times per pytest worker in `make test`. After a test during which
# one ran, what is left is collected and frozen (`gc.freeze()`): later collections walk only what was
# made since. What is frozen outlives its test (modules, session and module fixtures), so nothing a
# test makes is kept from the collector. Measured: BENCHMARKS.md.
_full_collection = False


def _saw_full_collection(phase: str, info: dict) -> None:
    global _full_collection
    if phase == "stop" and info["generation"] == 2:
        _full_collection = True


def pytest_sessionstart(session):
    gc.callbacks.append(_saw_full_collection)


def pytest_runtest_logfinish(nodeid, location):  # after the test's teardown
    global _full_collection
    if _full_collection:
        gc.collect()
        gc.freeze()
        _full_collection = False


# gcsfs' default filesystem (its "extended" one) asks GCS's Storage Control API over gRPC for each
# bucket's layout, which the emulator does not serve (each lookup then waits out its retries): the
# tests use gcsfs' core filesystem, which every non-zonal bucket uses anyway. Read at gcsfs' import.
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"

# Fast generation settings for every test job: 32x32, a quarter of the tiny model's native 64x64 (its
# images cost 2.8x less CPU; a test that needs the native size says so); one worker (a Ray worker costs
# ~8 s of CPU to start: `make test` is CPU-bound), where a test does not ask for more.
FAST = {"steps": 2, "guidance": 5.0, "width": 32, "height": 32, "device": "cpu", "workers": 1}


ROOT = Path(__file__).resolve().parents[1]


def fast_settings(**over):
    """What a `FAST` job's workers make with (its GenerationSettings), `over` on top."""
    from fleetgen.workers.spec import GenerationSettings

    return GenerationSettings(
        **{
            "family": "sd",
            "task": "text-to-image",
            **{k: FAST[k] for k in ("steps", "guidance", "width", "height")},
            **over,
        }
    )


def make_job(prompts, model: str, out, **kw):
    """A validated job at the tiny sizes (`FAST`), `kw` over them."""
    from fleetgen.jobs.config import JobConfig, validate

    return validate(JobConfig.of(input=str(prompts), output=str(out), model=model, **{**FAST, **kw}))


def run_args(prompts, out, model: str, **options) -> list[str]:
    """`fleetgen run` arguments at the tiny sizes (`FAST`), `options` over them as `--name value`
    (underscores become dashes; None leaves an option out)."""
    args = ["--input", str(prompts), "--output", str(out), "--model", str(model)]
    for name, value in {**FAST, **options}.items():
        if value is not None:
            args += [f"--{name.replace('_', '-')}", str(value)]
    return args


def start_driver(args: list[str], env: dict | None = None, log: Path | None = None) -> subprocess.Popen:
    """`python -m fleetgen run ARGS` as a user starts it, from the repository root; its output to `log`
    (else pipes, text)."""
    out = (
        {"stdout": open(log, "w"), "stderr": subprocess.STDOUT}
        if log
        else {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    )
    return subprocess.Popen(
        [sys.executable, "-m", "fleetgen", "run", *args], cwd=ROOT, env=env or dict(os.environ), **out
    )


def wait_for_commits(out: Path, more_than: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Until more than `more_than` shards of `out` are committed, while `proc` (a driver) runs."""
    deadline = time.monotonic() + timeout
    while len(list((out / "shards").glob("*.parquet"))) <= more_than:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"no shard committed past {more_than}"
        time.sleep(0.1)


def kill_driver(proc: subprocess.Popen, timeout: float = 60) -> None:
    """SIGKILL a driver on the session's Ray, then wait until Ray has ended its job's workers: until
    their processes are gone one may still commit the shard it was making (Ray ends a dead driver's
    actors a moment after it notices), which a test counting what was committed before a rerun would
    miss. Ray's own tables (the GCS's; this session's Ray runs no dashboard for the state API)."""
    import psutil
    from ray._private.state import state

    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=timeout)
    deadline = time.monotonic() + timeout
    while True:
        jobs = {j["JobID"]: j["IsDead"] for j in state.job_table() if j["DriverPid"] == proc.pid}
        pids = [a["Pid"] for a in state.actor_table(None).values() if a["JobID"] in jobs and a["Pid"]]
        if jobs and all(jobs.values()) and not any(psutil.pid_exists(p) for p in pids):
            return
        assert time.monotonic() < deadline, f"Ray did not end driver {proc.pid}'s job: {jobs}"
        time.sleep(0.2)


def inner_pytest(where: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """`python -m pytest -q -n 2 ARGS` in `where` (a folder of test files a test wrote), with this
    repository importable and `env` set; asserted to pass. Without this run's xdist variables: the inner
    run's controller would take itself for one of this run's workers."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider", *args],
        cwd=where,
        env={**clean, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def write_prompts(path: Path, prompts: list, row_group_size: int | None = None, **columns) -> Path:
    table = pa.table({"prompt": pa.array(prompts, pa.string()), **columns})
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def setup_job(tmp_path, model, out, output_format, prompts=None, max_batch=3, shard_rows=3, **kw):
    """A worker (in this process, no Ray) and the two shards of a 6-row input, with the job record
    verify looks for: the work of a job, shard by shard, without a cluster."""
    from fleetgen.jobs.sharding import plan_shards, read_footer, resolve_columns
    from fleetgen.workers.rows.shard import Columns
    from fleetgen.workers.spec import WorkerSpec
    from fleetgen.workers.worker import Worker

    prompts = prompts or [f"a lighthouse number {i}" for i in range(6)]
    path = write_prompts(tmp_path / f"p-{len(prompts)}.parquet", prompts, id=[f"r{i}" for i in range(len(prompts))])
    files = [read_footer(str(path))]
    settings = fast_settings(output_format=output_format)
    worker = Worker(
        WorkerSpec.of(
            "w0",
            model,
            str(out),
            settings,
            resolve_columns(files, Columns()),
            max_batch=max_batch,
            device="cpu",
            threads=1,
            **kw,
        )
    )
    # the part of the job record verify reads: the generation settings, the output format among them
    worker.output.put("job.json", json.dumps({"fingerprint": {"generation": dataclasses.asdict(settings)}}).encode())
    return worker, plan_shards(files, shard_rows)


def run_one_shard(model, out, prompts, settings, rows: int = 100, shards=(0,), **spec):
    """A worker in this process (no Ray, CPU) makes the whole of a small prompt file (up to `rows`) as
    one shard; returns the worker and {id: its manifest row}. `spec`: WorkerSpec fields (max_batch,
    offload, ...). `shards`: which of the file's shards of `rows` rows to make (a job's reference for
    some of its shards: the same rows, the same batches)."""
    from fleetgen.jobs.sharding import plan_shards, read_footer, resolve_columns
    from fleetgen.workers.rows.shard import Columns
    from fleetgen.workers.spec import WorkerSpec
    from fleetgen.workers.worker import Worker

    files = [read_footer(str(prompts))]
    planned, columns = plan_shards(files, rows), resolve_columns(files, Columns())
    worker = Worker(WorkerSpec.of("w0", model, str(out), settings, columns, device="cpu", **spec))
    for index in shards:
        worker.run_shard(planned[index])
    return worker, {r["id"]: r for r in pq.read_table(Path(out) / "shards").to_pylist()}


def foreign_lock(out: Path, token: str, host: str, pid: int) -> str:
    """`out/_LOCK` as another driver (`host`, `pid`) writes it, with a fresh heartbeat; its text."""
    record = {"token": token, "owner": f"{host} pid {pid}", "host": host, "pid": pid}
    text = json.dumps({**record, "started": time.time(), "heartbeat": time.time()})
    (out / "_LOCK").write_text(text)
    return text


def pixels(out, row):
    """An image of a files-format job, as float64 pixels."""
    import numpy as np
    from PIL import Image

    return np.asarray(Image.open(Path(out) / row["image"]), dtype=np.float64)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from fleetgen.workers.tiny import write_tiny_model

    return str(write_tiny_model(tmp_path_factory.mktemp("models") / "tiny"))


@pytest.fixture(scope="session")
def tiny_clip(tmp_path_factory) -> str:
    """A tiny random-weight CLIP (`--score clip=DIR`)."""
    from fleetgen.workers.tiny.scorers import write_tiny_scorer

    return str(write_tiny_scorer(tmp_path_factory.mktemp("scorers") / "clip", "clip"))


@pytest.fixture(scope="session")
def tiny_flux(tmp_path_factory) -> str:
    """The tiny FLUX.1 [dev] (its transformer takes step caches and attention backends)."""
    from fleetgen.workers.tiny import write_tiny_model

    return str(write_tiny_model(tmp_path_factory.mktemp("models") / "flux", family="flux"))


@pytest.fixture(scope="session")
def meta_build():
    """`build_on_meta` (the shipped architectures on the `meta` device), each built once per pytest
    worker: the planner's test modules all start from them (about 5 s for the fifteen, imports aside),
    and nothing changes a built module."""
    from functools import cache

    from fleetgen.offload.architectures import build_on_meta

    return cache(build_on_meta)


FAMILIES_2024 = ("sd", "sdxl", "sd3", "flux", "pixart-sigma", "sana")


@pytest.fixture(scope="session")
def family_models(tmp_path_factory) -> dict[str, str]:
    """A tiny model of each 2023-24 family, by family."""
    from fleetgen.workers.tiny import write_tiny_model

    root = tmp_path_factory.mktemp("families")
    return {f: str(write_tiny_model(root / f, family=f)) for f in FAMILIES_2024}


# What each 2025-26 model's card (its published example call) and the pipeline's `__call__` say, written
# here independently of the family table: (steps, guidance, dtype, how a negative prompt is taken).
CARDS = {
    "flux2": (50, 4.0, "bfloat16", "none"),  # FLUX.2-dev: 50 steps, guidance 4, no negative prompt
    "flux2-klein": (4, 1.0, "bfloat16", "none"),  # klein 4B/9B distilled: 4 steps, guidance 1
    "flux2-klein-base": (50, 4.0, "bfloat16", "none"),  # klein base: 50 steps, guidance 4 (CFG)
    "qwen-image": (50, 4.0, "bfloat16", "negative_prompt"),  # true_cfg_scale 4, negative " "
    "z-image-turbo": (9, 0.0, "bfloat16", "negative_prompt"),  # 9 steps, guidance 0
    "z-image": (50, 4.0, "bfloat16", "negative_prompt"),
    "hunyuanimage": (50, 3.5, "bfloat16", "negative_prompt"),
    "hunyuanimage-distilled": (8, 3.25, "bfloat16", "none"),  # distilled_guidance_scale 3.25
    "chroma": (40, 3.0, "bfloat16", "negative_prompt"),  # Chroma1-HD: 40 steps, guidance 3
    "hidream": (50, 5.0, "bfloat16", "negative_prompt"),  # I1-Full: 50 steps, guidance 5
    "hidream-dev": (28, 0.0, "bfloat16", "negative_prompt"),  # I1-Dev: 28 steps, guidance 0
    "hidream-fast": (16, 0.0, "bfloat16", "negative_prompt"),  # I1-Fast: 16 steps, guidance 0
}


@pytest.fixture(scope="session")
def frontier_models(tmp_path_factory) -> dict[str, str]:
    """One tiny model per 2025-26 entry, in a directory named as its checkpoint is (names tell Z-Image from
    Turbo and HiDream Full, Dev and Fast apart)."""
    from fleetgen.workers.tiny import write_tiny_model

    root = tmp_path_factory.mktemp("frontier")
    return {f: str(write_tiny_model(root / f, family=f)) for f in CARDS}


def png(color, size=(96, 80)) -> bytes:
    """A plain image of `color`, PNG-encoded."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return buf.getvalue()


def stop_tree(proc: subprocess.Popen) -> None:
    """Stop a process we started and everything under it (the fake nodes are the autoscaler's
    children), by pid."""
    import psutil

    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    for p in family:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(family, timeout=10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


STORES = ("s3", "gcs", "azure")  # the object stores of tests/stores.py; "local" is a folder


@pytest.fixture(scope="session")
def _stores_env():
    """Where each store's server and proxy will listen, in this process's environment (s3fs finds
    the proxy through AWS_ENDPOINT_URL, gcsfs through STORAGE_EMULATOR_HOST, adlfs through
    AZURE_STORAGE_CONNECTION_STRING), before the session's Ray starts, so that its workers inherit
    it. Nothing is started here: a server and its proxy start when a test asks for them."""
    from tests.stores import planned, quiet_clients

    quiet_clients()
    stores = {name: planned(name) for name in STORES}
    saved = [store.set_env() for store in stores.values()]
    yield stores
    for store, restore in zip(stores.values(), saved, strict=True):
        store.restore_env(restore)


def _started(stores: dict, name: str):
    store = stores[name]
    if store.proxy is None:
        if name == "s3":
            pytest.importorskip("s3fs")
        store.start()
    return store


@pytest.fixture(scope="session")
def _s3_stack(_stores_env):
    """A real S3 API (moto) on 127.0.0.1 behind a fault-injecting proxy (tests/faulty_store.py,
    faults off unless a test turns them on)."""
    store = _started(_stores_env, "s3")
    yield store.proxy
    store.stop()


@pytest.fixture(scope="session")
def _gcs_stack(_stores_env):
    """fake-gcs-server on 127.0.0.1 behind the proxy."""
    store = _started(_stores_env, "gcs")
    yield store
    store.stop()


@pytest.fixture(scope="session")
def _azure_stack(_stores_env):
    """Azurite's blob service on 127.0.0.1 behind the proxy (skipped, saying why, where it is not installed:
    `make test-fast` runs without npm; `make test` installs it first)."""
    from tests.stores import AZURITE

    if not AZURITE.exists():
        pytest.skip(f"Azurite (the Azure emulator, from npm) is not at {AZURITE}: `make azurite` installs it")
    store = _started(_stores_env, "azure")
    yield store
    store.stop()


@pytest.fixture(scope="session")
def s3_server(_s3_stack) -> str:
    """The S3 endpoint tests talk to (the proxy, faults off)."""
    return _s3_stack.endpoint


@pytest.fixture
def faulty_store(_s3_stack):
    """The proxy in front of the S3 server, for a test that injects faults; off again afterwards."""
    _s3_stack.reset()
    yield _s3_stack
    _s3_stack.reset()


LAG = 0.25  # seconds the `slow_s3` proxy holds every answer


def lag(proxy, seconds: float) -> None:
    """Every answer of the store's fault proxy `seconds` late and nothing else faulted; 0: neither."""
    from tests.faulty_store import FAULTS

    proxy.reset(**({"rate": 1.0, "seed": 0, **{f: 0.0 for f in FAULTS if f != "latency"}} if seconds else {}))
    if seconds:
        proxy.delay = seconds


@pytest.fixture
def slow_s3(_stores_env, _s3_stack):
    """The S3 server behind its proxy with every answer `LAG` s late (`lag`): a job on it lasts as long
    as its store makes it, at almost no CPU, as a job on a GPU waits on its device: for a test whose job
    must outlast something else (a node joining and dying) without burning the two cores that `make test`
    shares. `lag(store.proxy, 0)` makes it fast again."""
    delay = _s3_stack.delay
    lag(_s3_stack, LAG)
    yield _stores_env["s3"]
    lag(_s3_stack, 0)
    _s3_stack.delay = delay


@pytest.fixture(params=["local", *STORES])
def store(request, _stores_env, tmp_path):
    """Each store in turn (a local folder, S3, GCS, Azure), its proxy's faults off before and after:
    the behavioural suite every backend passes (tests/e2e/test_stores.py)."""
    from tests.stores import Store

    if request.param == "local":
        yield Store("local", "file", root=tmp_path)
        return
    started = request.getfixturevalue(f"_{request.param}_stack")
    store = started if request.param != "s3" else _stores_env["s3"]
    store.proxy.reset()
    yield store
    store.proxy.reset()


@pytest.fixture(scope="session")
def ray_cluster(_stores_env):
    """One local Ray for the whole run, its workers inheriting where the stores listen (which start
    only for the tests that ask for them) and making one try per store request, as this process does
    (`tests.stores.quiet_clients`). The session is one `fleetgen.warm_workers()` block, as a notebook
    running job after job would be: a test's job takes the workers an earlier one left parked when it
    asks for the same resources and environment (cluster/warm.py; each worker process's start is
    seconds of imports, most of this suite's CPU). Tests of the cold start run outside it (the
    `fleetgen` commands, `ray job submit`, chaos kills, a test's own Ray head)."""
    from fleetgen import warm_workers
    from tests.stores import start_local_ray

    ray = start_local_ray()  # a Ray of this pytest worker's own, never another's (`make test` runs two)
    with warm_workers():
        yield ray
    ray.shutdown()


@pytest.fixture
def ray_address(ray_cluster):
    """The session Ray's address, for a driver of another process (a `fleetgen` command, a script) to
    join: the workers this session left parked are killed first, as they hold the CPUs that driver's
    workers will ask for (cluster/warm.py)."""
    from fleetgen.cluster.warm import free_parked

    free_parked()
    return ray_cluster.get_runtime_context().gcs_address


RAY_FIXTURES = {"ray_cluster"}
CLUSTER_FIXTURES = {"ray_head", "autoscaling_head"}
CLUSTER_GROUP = "cluster"  # the xdist_group of the tests marked `cluster`
RAY_GROUP = "ray"  # the xdist_group of the tests on the session's Ray (marked `ray`)
# Module fixtures that run whole jobs (10-20 s of CPU each): the tests sharing one go to one pytest
# worker, so that it is made once, not once on each (those on the session's Ray are in its group).
SHARED_JOBS = {"chaos_input", "finished", "reference"}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(items):
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if names & RAY_FIXTURES:
            item.add_marker(pytest.mark.ray)
        if names & CLUSTER_FIXTURES:
            item.add_marker(pytest.mark.cluster)
        # `make test` runs two pytest workers (`-n 2 --dist loadgroup`; xdist sends the largest group
        # first). The tests that start Ray heads of their own (1.5-1.7 cores each, minutes long) go to
        # one worker, one after the other; the tests on the session's Ray go to the other, one after
        # the other, on one session Ray (`ray_cluster`): one Ray's processes instead of two, and one
        # pool of parked workers for all of them to reuse (a worker's start is 5-10 s of CPU, imports
        # mostly). Every other test goes to whichever worker is free. Measured: BENCHMARKS.md.
        if item.get_closest_marker("cluster"):
            item.add_marker(pytest.mark.xdist_group(CLUSTER_GROUP))
        elif item.get_closest_marker("ray"):
            item.add_marker(pytest.mark.xdist_group(RAY_GROUP))
        elif names & SHARED_JOBS:
            item.add_marker(pytest.mark.xdist_group(f"{item.module.__name__}:{min(names & SHARED_JOBS)}"))
    # In the session Ray's group, the modules whose drivers run in other processes (`ray_address`
    # kills the parked workers first: they hold the CPUs) after those that reuse the parked workers;
    # a module's tests stay together (its module fixtures are made once).
    freeing = {item.module.__name__ for item in items if "ray_address" in getattr(item, "fixturenames", ())}
    items.sort(key=lambda item: item.get_closest_marker("ray") is not None and item.module.__name__ in freeing)


def _ray_starts() -> int:
    """In-process Ray connections so far: ours (cluster.connect) and any other `ray.init`."""
    ray, connect = sys.modules.get("ray"), sys.modules.get("fleetgen.cluster.connect")
    return getattr(connect, "inits", 0) + (1 if ray is not None and ray.is_initialized() else 0)


@pytest.fixture(autouse=True)
def _marked_for_ray(request):
    """A test that starts an in-process Ray without asking for the shared one would run unmarked
    (and start a Ray of its own, slowly): it fails, naming the fixture to ask for."""
    before = _ray_starts()
    yield
    if "ray_cluster" not in request.fixturenames and _ray_starts() > before:
        pytest.fail("this test started Ray: ask for the `ray_cluster` fixture (it marks the test `ray`)")

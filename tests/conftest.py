"""Shared fixtures: the tiny model, prompt files, a real S3 server on loopback, one local Ray."""

from __future__ import annotations

import atexit
import os
import shutil
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
# The hub of the tests is tests/hub_server.py on a loopback port chosen here, with a cache of its
# own (never the user's). Set before anything imports huggingface_hub (it reads HF_ENDPOINT at
# import) and before any Ray starts (its workers inherit them); files come over plain HTTP.
_HF_HOME = tempfile.mkdtemp(prefix="fleetgen-hf-")
atexit.register(shutil.rmtree, _HF_HOME, ignore_errors=True)
with socket.socket() as _s:
    _s.bind(("127.0.0.1", 0))
    HUB_PORT = _s.getsockname()[1]
os.environ.update(HF_HOME=_HF_HOME, HF_ENDPOINT=f"http://127.0.0.1:{HUB_PORT}", HF_HUB_DISABLE_XET="1")

# Fast generation settings for every test job: 64x64 is the tiny model's native size.
FAST = {"steps": 2, "guidance": 5.0, "width": 64, "height": 64, "device": "cpu"}


def write_prompts(path: Path, prompts: list, row_group_size: int | None = None, **columns) -> Path:
    table = pa.table({"prompt": pa.array(prompts, pa.string()), **columns})
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from workers.tiny_model import write_tiny_model

    return str(write_tiny_model(tmp_path_factory.mktemp("models") / "tiny"))


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


@pytest.fixture(scope="session")
def s3_server():
    """A real S3 API (moto) on 127.0.0.1; s3fs finds it through AWS_ENDPOINT_URL."""
    pytest.importorskip("s3fs")
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("moto server did not start") from None
            time.sleep(0.2)
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield endpoint
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(scope="session")
def ray_cluster(s3_server):
    """One local Ray for the whole run (after the S3 server, so its workers inherit its env)."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()

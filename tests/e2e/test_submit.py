"""`ray job submit` against a real Ray head started here (loopback, its own temp dir), as a user
submits fleetgen to a cluster; plus the cluster configs shipped in cluster/."""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from fleetgen.cluster.actor import GPU_TYPE_PREFIX
from tests.conftest import _free_port, run_args, stop_tree, write_prompts

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


_TOKEN: dict[str, str] = {}  # the head's auth token, as `ray get-auth-token` prints it on the head


def _env() -> dict:
    """A client of the head as the README says to be one: the head uses token authentication, the
    client says `RAY_AUTH_MODE=token` and gives the head's token in RAY_AUTH_TOKEN."""
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", **_TOKEN}
    env.pop("RAY_ADDRESS", None)
    # The job's `python` is whatever the head's PATH finds, as on a real cluster: make it this
    # environment's (make runs the tests without activating .venv).
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


@pytest.fixture(scope="module")
def ray_head():
    """`ray start --head --block` on 127.0.0.1, shared by this module's jobs; stopped with what it started."""
    ports = {
        name: _free_port()
        for name in (
            "port",
            "dashboard-port",
            "ray-client-server-port",
            "dashboard-agent-listen-port",
            "metrics-export-port",
        )
    }
    temp = tempfile.mkdtemp(prefix="rayh", dir="/tmp")  # short: Ray's socket paths are length-limited
    cmd = [
        str(BIN / "ray"),
        "start",
        "--head",
        "--block",
        "--node-ip-address",
        "127.0.0.1",
        "--num-cpus",
        "2",
        "--include-dashboard",
        "true",
        "--dashboard-host",
        "127.0.0.1",
        "--temp-dir",
        temp,
        "--disable-usage-stats",
        *[a for k, v in ports.items() for a in (f"--{k}", str(v))],
    ]
    # A head with token authentication, as Ray 2.60 starts one wherever ~/.ray/auth_token exists (any
    # earlier `ray.init()` on the machine writes it); its home of its own, never the user's ~/.ray.
    home = Path(temp) / "home"
    home.mkdir()
    # metrics within ~1 s; the head's own temporary files (its dashboard's multiprocessing sockets, which
    # its killed processes leave behind) in its temp dir, removed with it
    env = {**_env(), "HOME": str(home), "TMPDIR": temp, "RAY_metrics_report_interval_ms": "1000"}
    env.pop("RAY_AUTH_MODE", None)
    subprocess.run(
        [str(BIN / "ray"), "get-auth-token", "--generate"], env=env, capture_output=True, timeout=60, check=True
    )
    log = open(Path(temp) / "head.log", "w")
    head = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    address = f"http://127.0.0.1:{ports['dashboard-port']}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{address}/api/version", timeout=2)
                break
            except urllib.error.HTTPError:  # it answers (401 without the auth token): it is up
                break
            except OSError:
                assert head.poll() is None, (Path(temp) / "head.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "the Ray head's dashboard did not come up"
                time.sleep(1)
        token = subprocess.run(
            [str(BIN / "ray"), "get-auth-token"], env=env, capture_output=True, text=True, timeout=60
        ).stdout.strip()
        assert token and token == (home / ".ray" / "auth_token").read_text().strip()
        assert "Token authentication is enabled" in (Path(temp) / "head.log").read_text()
        _TOKEN.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
        yield address, ports["metrics-export-port"]
    finally:
        _TOKEN.clear()
        stop_tree(head)
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


def _metrics(port: int) -> list[str]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return [line for line in text.splitlines() if line.startswith("ray_fleetgen_")]


def _ray(*args, timeout=120) -> str:
    done = subprocess.run([str(BIN / "ray"), *args], env=_env(), capture_output=True, text=True, timeout=timeout)
    return done.stdout + done.stderr


def _readme_submit(address: str, prompts: Path, out: Path, model: str) -> list[str]:
    """The README's `ray job submit` command, by copy: its address, input, output and model replaced
    by this test's, then `--no-wait` (to watch the job while it runs) and the tiny sizes."""
    line = next(line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("ray job submit"))
    words = line.split()
    for flag, value in (("--address", address), ("--input", str(prompts)), ("--output", str(out)), ("--model", model)):
        words[words.index(flag) + 1] = value
    assert words[:3] == ["ray", "job", "submit"] and words[words.index("--working-dir") + 1] == "."
    tiny = run_args(prompts, out, model, guidance=None, steps=32, rows_per_shard=2, max_batch=1, workers=2)
    tiny = tiny[tiny.index("--steps") :]  # input, output and model are the README's
    return ["job", "submit", "--no-wait", *words[3:], *tiny]


def _submit(words: list[str], env_vars: dict | None = None, extra: tuple[str, ...] = ()) -> str:
    """Submit from the repository (the README's `--working-dir .`); `env_vars` in the job's runtime env."""
    at = words.index("--working-dir") + 2
    runtime_env = ["--runtime-env-json", json.dumps({"env_vars": env_vars})] if env_vars else []
    cmd = [str(BIN / "ray"), *words[:at], *runtime_env, *words[at:], *extra]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return re.search(r"(raysubmit_\w+)", done.stdout + done.stderr).group(1)


def _committed(out: Path) -> int:
    return len(list((out / "shards").glob("*.parquet"))) if (out / "shards").exists() else 0


def _ended(address: str, job_id: str) -> str | None:
    """The job's status if it has ended, else None: asked of the head's Jobs REST API (what `ray job
    status` asks, one request instead of a process importing Ray), with the client's token."""
    request = urllib.request.Request(
        f"{address}/api/jobs/{job_id}", headers={"Authorization": f"Bearer {_TOKEN['RAY_AUTH_TOKEN']}"}
    )
    status = json.loads(urllib.request.urlopen(request, timeout=10).read())["status"].lower()
    return status if status in ("succeeded", "failed", "stopped") else None


def _wait_committed(out: Path, at_least: int, address: str, job_id: str) -> int:
    deadline = time.monotonic() + 180
    while (n := _committed(out)) < at_least:
        ended = _ended(address, job_id)
        assert time.monotonic() < deadline and not ended, (ended or "") + _ray(
            "job", "logs", "--address", address, job_id
        )[-3000:]
        time.sleep(0.2)
    return n


def _wait_metrics(metrics_port: int, address: str, job_id: str) -> dict[str, str]:
    """The workers' metrics as Prometheus would scrape the node while the job runs."""
    seen: dict[str, str] = {}
    wanted = {"ray_fleetgen_images", "ray_fleetgen_images_per_second"}
    deadline = time.monotonic() + 240
    while not wanted <= {k.split("{")[0].removesuffix("_total") for k in seen}:
        if time.monotonic() > deadline or _ended(address, job_id):
            logs = _ray("job", "logs", "--address", address, job_id)[-3000:]
            pytest.fail(f"fleetgen metrics not seen while the job ran (seen: {sorted(seen)}); job log:\n{logs}")
        seen.update({line.rsplit(" ", 1)[0]: line.rsplit(" ", 1)[1] for line in _metrics(metrics_port)})
        time.sleep(0.5)
    return seen


@pytest.mark.slow
def test_readme_submit_then_ray_job_stop_writes_summary_and_releases_the_lock_then_a_resubmit_resumes(
    ray_head, tiny_model, tmp_path
):
    """The README's `ray job submit` (with `--working-dir .`) as a user types it, three times over one
    output. The workers' metrics are scraped while it runs. `ray job stop` SIGTERMs the driver and
    SIGKILLs it `RAY_JOB_STOP_WAIT_TIME_S` later (3 s by default): within that the driver stops
    dispatching, writes summary.json and releases _LOCK. A job submitted with a longer window in its
    runtime env (docs/running.md's second command) gives running shards `--stop-grace` to commit. A
    resubmit resumes and succeeds, every row once."""
    address, metrics_port = ray_head
    # 12 shards of 2 rows: the first job commits about 4 before its stop and the second 2 more, so a third
    # is left to resume whatever the machine's speed (with 8, an idle machine's second job finished all)
    rows = 24
    prompts = write_prompts(tmp_path / "p.parquet", [f"stop me {i}" for i in range(rows)])
    out = tmp_path / "out"
    words = _readme_submit(address, prompts, out, tiny_model)

    # Ray's default window: nothing running gets to finish, but what the driver must write is written.
    first = _submit(words)
    seen = _wait_metrics(metrics_port, address, first)
    rates = {k: float(v) for k, v in seen.items() if k.startswith("ray_fleetgen_images_per_second{")}
    assert rates and all('device="cpu' in k and re.search(r'worker="w[01]"', k) for k in rates)
    assert all(v > 0 for v in rates.values())
    _wait_committed(out, 1, address, first)
    _ray("job", "stop", "--address", address, first)
    assert "stopped" in _ray("job", "status", "--address", address, first).lower()
    logs = _ray("job", "logs", "--address", address, first)
    assert "[fleetgen] up to 2 worker(s) on CPU" in logs  # plain progress lines: the job log is not a TTY
    assert "SIGTERM: no new shards" in logs, logs[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped"] and not summary["complete"] and summary["exit_code"] == 1
    assert not (out / "_LOCK").exists()
    assert "stopped before the end; rerun the same command to resume" in logs  # its last words: not SIGKILLed

    # A longer window, asked for in the job's runtime env: running shards commit within `--stop-grace`.
    docs = (ROOT / "docs" / "running.md").read_text()
    assert '--runtime-env-json \'{"env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "120"}}\'' in docs
    # the stopped job's workers die seconds later, but commit nothing more: the driver released the lock
    # (checked above) and a worker commits only while the lock names its driver (workers/output/commit.py)
    base = _committed(out)
    # one worker: at most one shard runs when the stop lands, so the stop leaves work for the resubmit
    # however late it lands (with two, the last two shards could both be running and commit in grace)
    second = _submit(words, env_vars={"RAY_JOB_STOP_WAIT_TIME_S": "90"}, extra=("--stop-grace", "60", "--workers", "1"))
    before = _wait_committed(out, base + 1, address, second)
    _ray("job", "stop", "--address", address, second, timeout=120)
    logs = _ray("job", "logs", "--address", address, second)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped"] and not (out / "_LOCK").exists(), logs[-3000:]
    assert summary["shards_committed"] > before, logs[-3000:]  # the shards running at the stop committed
    assert _committed(out) < rows // 2

    # Resubmitted at once: the lock is free, committed shards are skipped, the job succeeds.
    third = _submit(words)
    final = _ray("job", "logs", "--follow", "--address", address, third, timeout=300)
    assert "succeeded" in _ray("job", "status", "--address", address, third).lower(), final[-3000:]
    assert "resuming:" in final and (out / "_SUCCESS").exists()
    ids = [r["id"] for r in pq.read_table(out / "shards", columns=["id"]).to_pylist()]
    assert len(ids) == rows == len(set(ids))
    assert len(list((out / "images").rglob("*.png"))) == rows


CLUSTER = ROOT / "cluster"


def _entrypoint_runs(command: str) -> None:
    """The command a config submits must name something that exists in this repository."""
    words = command.split()
    assert "jobs" in words or "fleetgen" in words, command
    if "-m" in words:
        assert (ROOT / words[words.index("-m") + 1] / "__main__.py").exists()
    if "fleetgen" in words:
        assert 'fleetgen = "fleetgen.cli:main"' in (ROOT / "pyproject.toml").read_text()
    assert "run" in words


def test_cluster_launcher_yaml_has_three_gpu_node_types():
    config = yaml.safe_load((CLUSTER / "ray-cluster.yaml").read_text())
    types = config["available_node_types"]
    gpus = {name: t["resources"].get("GPU", 0) for name, t in types.items()}
    assert sum(1 for g in gpus.values() if g) >= 3
    assert config["head_node_type"] in types
    memory = {t.get("labels", {}).get("fleetgen/gpu-memory") for t in types.values() if t["resources"].get("GPU")}
    assert {"24GiB", "48GiB", "80GiB"} <= memory
    assert any("pip install" in c and "fleetgen" in c for c in config["setup_commands"])
    assert any("torch.version.cuda" in c for c in config["setup_commands"])  # a CPU-only torch fails the setup
    for name, t in types.items():
        if t["resources"].get("GPU"):  # started by demand, named for reports
            assert t["min_workers"] == 0, name
            gpu_types = [k for k in t["resources"] if k.startswith(GPU_TYPE_PREFIX)]
            assert len(gpu_types) == 1 and t["resources"][gpu_types[0]] == t["resources"]["GPU"], name


def test_kuberay_rayjob_has_a_worker_group_per_gpu_type():
    docs = list(yaml.safe_load_all((CLUSTER / "kuberay-rayjob.yaml").read_text()))
    job = next(d for d in docs if d["kind"] == "RayJob")
    _entrypoint_runs(job["spec"]["entrypoint"])
    groups = job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    gpu_groups = [
        g for g in groups if g["template"]["spec"]["containers"][0]["resources"]["limits"].get("nvidia.com/gpu")
    ]
    assert len(gpu_groups) >= 3
    assert len({g["groupName"] for g in gpu_groups}) == len(gpu_groups)
    assert job["spec"]["rayClusterSpec"]["enableInTreeAutoscaling"] is True
    for g in gpu_groups:
        assert g["minReplicas"] == 0
        resources = json.loads(g["rayStartParams"]["resources"].strip('"').replace('\\"', '"'))
        assert [k for k in resources if k.startswith(GPU_TYPE_PREFIX)], g["groupName"]
    runtime_env = yaml.safe_load(job["spec"]["runtimeEnvYAML"])
    assert any(p.startswith("torch") for p in runtime_env["pip"])  # rayproject/ray:*-gpu has no torch


def test_readme_submits_with_an_entrypoint_that_exists():
    text = (ROOT / "README.md").read_text() + (ROOT / "docs" / "running.md").read_text()
    lines = [line for line in text.splitlines() if line.startswith("ray job submit")]
    assert lines
    for line in lines:
        _entrypoint_runs(line.split(" -- ", 1)[1])

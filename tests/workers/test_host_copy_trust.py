"""The node's copy trusts only its own user's sealed work (workers/pipeline/segment.py): another user who
creates every path first (a valid manifest, garbage data, a link where the data goes) changes no pixel and
touches no file of ours; two users of one node each get their own; a tmpfs that fills while the copy is
written, a write that fails half-way and a writer that never finishes cost a worker its shared copy, never
its life; a mapping outlives its worker's leaving while modules still use it."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from fleetgen.workers.pipeline.segment import segment_key
from tests.conftest import ROOT
from tests.workers.test_host_copy import _child_holding, _image, _kill, _load

NOBODY = 65534  # the uid (and gid) of the other user


@pytest.fixture
def base(monkeypatch):
    """A node-shared directory as /dev/shm is one: world-writable and sticky; removed at the end."""
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    where = Path(tempfile.mkdtemp(prefix="fleetgen-trust-", dir=root))
    where.chmod(0o1777)
    monkeypatch.setenv("FLEETGEN_SHM_DIR", str(where))
    yield where
    shutil.rmtree(where, ignore_errors=True)


@pytest.fixture
def shared_model(tiny_model):
    """The tiny model where another user can read it (pytest's own folders are its user's only)."""
    where = Path(tempfile.mkdtemp(prefix="fleetgen-trust-model-"))
    where.chmod(0o755)
    shutil.copytree(tiny_model, where / "tiny")
    for p in where.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    yield str(where / "tiny")
    shutil.rmtree(where, ignore_errors=True)


@pytest.fixture
def as_other_user():
    """`run(code, *args)`: `code` run by another user (uid 65534) in a process of its own, with a home
    of its own, removed after the test; skipped where this user cannot."""
    if shutil.which("setpriv") is None or os.geteuid() != 0:
        pytest.skip("needs root and setpriv (util-linux) to run a process as another user")
    homes = []

    def run(code: str, *args: str) -> subprocess.Popen:
        home = Path(tempfile.mkdtemp(prefix="fleetgen-other-home-"))
        homes.append(home)
        os.chown(home, NOBODY, NOBODY)
        env = {**os.environ, "HOME": str(home), "HF_HOME": str(home / "hf"), "PYTHONDONTWRITEBYTECODE": "1"}
        cmd = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", sys.executable, "-c", code, *args]
        pipes = {k: subprocess.PIPE for k in ("stdin", "stdout", "stderr")}
        return subprocess.Popen(cmd, cwd=ROOT, env=env, text=True, **pipes)

    yield run
    for home in homes:
        shutil.rmtree(home, ignore_errors=True)  # this user is root: it may remove the other's files


PLANT = """
import fcntl, json, os, sys, time
from pathlib import Path
from fleetgen.workers.pipeline.segment import segment_key
base, model, target, uid = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
key = segment_key({"model": model, "dtype": "torch.float32"})
manifest = {"key": key, "total": 4096, "sealed": True, "writer": os.getpid(), "components": {}}
held = []
def plant(d):
    for k in ("lock", "users"):
        (d / f"fleetgen-{key}.{k}").write_text("")
    (d / f"fleetgen-{key}.json").write_text(json.dumps(manifest))
    os.symlink(target, d / f"fleetgen-{key}.data")  # the data path: a link to a file of the victim's
    fd = os.open(d / f"fleetgen-{key}.users", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_SH)  # held as a live user holds it
    held.append(fd)
plant(base)  # where the segment's files lay before: in the shared directory itself
mine = base / "theirs"
mine.mkdir(mode=0o777)
plant(mine)
if sys.argv[5] == "dir":
    (base / f"fleetgen-{uid}").mkdir(mode=0o777)  # the victim's directory, made first
    plant(base / f"fleetgen-{uid}")
else:
    os.symlink(mine, base / f"fleetgen-{uid}")  # the victim's directory: a link to one of ours
print("planted", flush=True)
time.sleep(600)
"""


@pytest.mark.chaos  # another user's processes
@pytest.mark.parametrize("how", ["dir", "link"])
def test_another_users_planted_copy_changes_no_pixel_and_no_file(
    shared_model, base, tmp_path, capsys, how, as_other_user
):
    """Another user creates every path of the copy first, with a valid manifest, garbage data and a link
    at the data path, and holds it as a live user: this user's worker keeps its own copy, says why and
    how to fix it in one line, makes the pixels of `--host-copy worker`, and the link's target (a file of
    its own) is untouched."""
    target = tmp_path / "precious"
    target.write_bytes(b"the victim's own bytes")
    planter = as_other_user(PLANT, str(base), shared_model, str(target), str(os.geteuid()), how)
    try:
        line = planter.stdout.readline()
        assert line.strip() == "planted", planter.stderr.read()[-2000:] if planter.poll() is not None else line
        _, own = _load(shared_model, "worker")
        hc, pipe = _load(shared_model, tag="victim")
        said = capsys.readouterr().out
        assert "[fleetgen] victim: host copy per worker, not per node:" in said, said
        why = "belongs to uid 65534" if how == "dir" else "is not a directory of this user's"
        assert why in said and "FLEETGEN_SHM_DIR to a directory only you can write" in said, said
        assert hc.segment is None and hc.record(pipe)["shared"] is False
        assert _image(pipe) == _image(own)
        assert target.read_bytes() == b"the victim's own bytes"
    finally:
        _kill(planter)


TWO_USERS = """
import json, sys
from tests.workers.test_host_copy import _load, _image
import hashlib
hc, pipe = _load(sys.argv[1], tag="other")
_, own = _load(sys.argv[1], "worker")
print(json.dumps({"role": hc.segment.role, "shared": sorted(hc.shared),
                  "same": _image(pipe) == _image(own)}), flush=True)
sys.stdin.readline()
hc.close()
"""


@pytest.mark.chaos  # another user's processes
def test_two_users_of_one_node_each_share_their_own_copy(shared_model, base, as_other_user):
    """Two users load one model with the node's copy on one node, each while the other holds its own:
    each writes and maps a copy in its own directory (no PermissionError, no fallback), the pixels of a copy
    of its own, and each removes its own files when it leaves."""

    other = as_other_user(TWO_USERS, shared_model)
    try:
        line = other.stdout.readline()
        assert line.startswith("{"), other.stderr.read()[-3000:] if other.poll() is not None else line
        theirs = json.loads(line)
        hc, pipe = _load(shared_model, tag="root")
        assert hc.segment.role == "wrote" and sorted(hc.shared) == theirs["shared"] == ["text_encoder", "unet", "vae"]
        assert theirs["role"] == "wrote"
        _, own = _load(shared_model, "worker")
        assert _image(pipe) == _image(own) and theirs["same"]  # each the pixels of a copy of its own
        dirs = {p.name: p.stat() for p in base.iterdir()}
        assert sorted(dirs) == sorted({f"fleetgen-{os.geteuid()}", f"fleetgen-{NOBODY}"})
        assert all((st.st_mode & 0o777) == 0o700 for st in dirs.values())
        assert dirs[f"fleetgen-{NOBODY}"].st_uid == NOBODY
        hc.close()
        assert list((base / f"fleetgen-{os.geteuid()}").iterdir()) == []
    finally:
        _kill(other)


def test_a_sealed_manifest_of_another_key_or_none_is_never_mapped(tiny_model, base):
    """In this user's own directory: a manifest that names another key, or is not sealed, beside garbage
    data, is never mapped; the worker writes the copy anew and makes a copy of its own's pixels."""
    _, own = _load(tiny_model, "worker")
    key = segment_key({"model": tiny_model, "dtype": "torch.float32"})
    mine = base / f"fleetgen-{os.geteuid()}"
    for manifest in ({"key": "another", "total": 64, "sealed": True}, {"key": key, "total": 64}):
        mine.mkdir(mode=0o700, exist_ok=True)
        (mine / f"fleetgen-{key}.json").write_text(json.dumps({**manifest, "components": {}}))
        (mine / f"fleetgen-{key}.data").write_bytes(b"\xff" * 64)
        hc, pipe = _load(tiny_model)
        assert hc.segment.role == "wrote" and hc.segment.manifest["key"] == key
        assert _image(pipe) == _image(own)
        hc.close()
        assert list(mine.iterdir()) == []


FAIL_MID_WRITE = """
import errno, hashlib, os, sys
from fleetgen.workers.pipeline import host_copy, segment
from tests.workers.test_host_copy import _load, _image
bound = []
original = host_copy.HostCopy._bind
def bind(self, name, module):
    original(self, name, module)
    bound.append(name)
host_copy.HostCopy._bind = bind
real = os.pwrite
def pwrite(fd, data, offset):
    if bound and not getattr(pwrite, "failed", False):  # the second component's first write fails
        pwrite.failed = True
        raise OSError(errno.EIO, os.strerror(errno.EIO))
    return real(fd, data, offset)
segment.os.pwrite = pwrite
hc, pipe = _load(sys.argv[1], tag="w")
assert hc.segment is None and bound, (hc.segment, bound)
for name in ("text_encoder", "unet", "vae"):  # every weight its own and writable: none left in a mapping
    for p in getattr(pipe, name).parameters():
        p.data.add_(0)
import gc; gc.collect()
_, own = _load(sys.argv[1], "worker")
print(hashlib.sha256(_image(pipe)).hexdigest(), hashlib.sha256(_image(own)).hexdigest(), flush=True)
"""

CLOSED_UNDER_VIEWS = """
import gc, hashlib, sys
from tests.workers.test_host_copy import _load, _image
hc, pipe = _load(sys.argv[1])
before = _image(pipe)
hc.close()  # the last user: its files removed, its hold dropped, while the pipeline still uses the mapping
gc.collect()
assert _image(pipe) == before
_, own = _load(sys.argv[1], "worker")
print(hashlib.sha256(before).hexdigest(), hashlib.sha256(_image(own)).hexdigest(), flush=True)
"""


@pytest.mark.slow  # two processes of their own, each importing torch and loading twice
@pytest.mark.parametrize("code", [FAIL_MID_WRITE, CLOSED_UNDER_VIEWS], ids=["write-fails", "left-under-views"])
def test_a_mapping_is_never_pulled_from_under_live_modules(tiny_model, base, code):
    """A write that fails after the first component (EIO): the worker goes on with its own copy, every
    weight private and writable (not a view of an unmapped or read-only mapping), the same pixels. A
    worker that leaves the copy while its modules still use it (the last user: files removed) keeps
    computing the same pixels: the mapping lasts as long as they do. (In a process of its own: a
    mapping pulled from under a module is a SIGSEGV.)"""

    proc = subprocess.run(
        [sys.executable, "-c", code, tiny_model], cwd=ROOT, capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    shared, own = proc.stdout.split()[-2:]  # its pixels, and a copy of its own's in the same process (threads)
    assert shared == own

    if code is FAIL_MID_WRITE:
        assert "host copy per worker, not per node: writing" in proc.stdout and "Input/output error" in proc.stdout
    assert list(base.iterdir()) in ([], [base / f"fleetgen-{os.geteuid()}"])
    assert not any((base / f"fleetgen-{os.geteuid()}").glob("*"))


@pytest.fixture
def mnt(tmp_path):
    """A 32 MiB tmpfs of this test's own (mode 1777, as /dev/shm), unmounted at the end; skipped, saying why,
    where this machine does not let a test mount one."""
    where = tmp_path / "shm"
    where.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=32m,mode=1777", "tmpfs", str(where)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


def fill_when_written(mnt: Path, filled: threading.Event, within: float = 240.0) -> None:
    """As another process of the node would: fill the tmpfs at `mnt` as soon as a copy's data file there is
    reserved (its size set: tmpfs sets it once fallocate has every page), as the weights are being written,
    then set `filled`. (Filling while fallocate is still reserving — it had blocks, not yet its size — made
    the reservation fail, ENOSPC, and the worker keep its own copy, saying so: the other safe outcome.)"""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if any(p.stat().st_size > 0 for p in mnt.glob("fleetgen-*/*.data")):
            with open(mnt / "filler", "wb") as f:
                try:
                    while True:
                        f.write(b"\0" * (1 << 20))
                        f.flush()
                except OSError:
                    filled.set()
                    return
        time.sleep(0.001)


@pytest.mark.chaos  # a tmpfs mounted and filled
def test_a_tmpfs_that_fills_while_the_copy_is_written_costs_nothing(tiny_model, mnt, monkeypatch):
    """The node's shared directory (a 32 MiB tmpfs) is filled by another process as soon as the data file
    holds its first block: the space was reserved before a byte was written, so the copy is written whole,
    mapped, and makes the pixels of a copy of its own; the filler got only what was left."""
    monkeypatch.setenv("FLEETGEN_SHM_DIR", str(mnt))
    filled = threading.Event()
    _, own = _load(tiny_model, "worker")
    filler = threading.Thread(target=fill_when_written, args=(mnt, filled), daemon=True)
    filler.start()
    hc, pipe = _load(tiny_model)
    filler.join(timeout=60)
    assert filled.is_set() and os.statvfs(mnt).f_bavail == 0  # the tmpfs was full while it was written
    assert hc.segment.role == "wrote" and sorted(hc.shared) == ["text_encoder", "unet", "vae"]
    assert _image(pipe) == _image(own)
    hc.close()


@pytest.mark.chaos  # a writer stalled for good, then killed
def test_a_wait_for_a_writer_that_never_finishes_ends_with_its_line(tiny_model, base, monkeypatch, capsys):
    """Another worker holds the guard writing the copy and never finishes: a worker waits at most
    FLEETGEN_HOST_COPY_WAIT seconds, says whom it waits for (the writer's pid and what it does), then
    keeps its own copy, naming the setting; its pixels are a copy of its own's."""
    _, own = _load(tiny_model, "worker")
    proc = _child_holding(tiny_model, "writing")
    try:
        monkeypatch.setenv("FLEETGEN_HOST_COPY_WAIT", "2")
        started = time.monotonic()
        hc, pipe = _load(tiny_model, tag="late")
        assert time.monotonic() - started < 30
        said = capsys.readouterr().out
        assert (
            f"waiting for another worker on this node to write the node's copy of the weights (pid {proc.pid}" in said
        )
        assert f"waited 2 s for pid {proc.pid} writing the node's copy of the weights" in said, said
        assert "(raise FLEETGEN_HOST_COPY_WAIT, or pass --host-copy worker)" in said and hc.segment is None
        assert _image(pipe) == _image(own)
    finally:
        _kill(proc)


@pytest.mark.chaos  # a tmpfs mounted and filled under a whole job
def test_a_job_whose_shared_memory_fills_as_the_copy_is_written_completes(tiny_model, mnt, tmp_path):
    """`fleetgen run` (its own local Ray, one worker with the node's copy) on a node whose shared directory
    (a 32 MiB tmpfs) another process fills as soon as the copy's data file holds its first block: the job
    completes with the pixels of `--host-copy worker`, its worker wrote and mapped the copy, and no worker
    was lost or restarted."""
    import pyarrow.parquet as pq

    from tests.conftest import write_prompts

    prompts = write_prompts(tmp_path / "p.parquet", ["a fox", "an owl", "a ship", "a cat"])
    env = {**os.environ, "FLEETGEN_SHM_DIR": str(mnt)}
    env.pop("RAY_ADDRESS", None)
    filled = threading.Event()

    def run(out: str, *more: str) -> subprocess.CompletedProcess:
        args = ["run", "--input", str(prompts), "--output", str(tmp_path / out), "--model", tiny_model]
        fast = ["--steps", "2", "--width", "32", "--height", "32", "--device", "cpu", "--workers", "1"]
        return subprocess.run(
            [sys.executable, "-m", "fleetgen", *args, *fast, *more],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )

    filler = threading.Thread(target=fill_when_written, args=(mnt, filled), daemon=True)
    filler.start()
    node = run("node")
    filler.join(timeout=10)
    (mnt / "filler").unlink(missing_ok=True)
    own = run("own", "--host-copy", "worker")
    said = node.stdout + node.stderr
    assert node.returncode == 0 and own.returncode == 0, said[-3000:]
    assert filled.is_set(), "the filler never saw the copy's data file"
    assert " lost (" not in said, said[-3000:]  # no worker lost, none restarted
    (record,) = (tmp_path / "node" / "workers").glob("w*.json")
    copy = json.loads(record.read_text())["host_copy"]
    assert copy.get("role") == "wrote" and copy["shared"] is True, json.dumps(copy)

    def pixels(out: str) -> dict:
        return {r["id"]: r["sha256"] for r in pq.read_table(tmp_path / out / "shards").to_pylist()}

    assert pixels("node") == pixels("own") and len(pixels("node")) == 4

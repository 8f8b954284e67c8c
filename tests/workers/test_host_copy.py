"""One host copy of the weights per node (workers/pipeline/host_copy.py): worker processes of one node
map one shared segment instead of holding a copy each; the same pixels; nothing left in the shared
directory after they go, after they are SIGKILLed, after one dies mid-write; too little shared memory
falls back to a copy per worker with its line."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fleetgen.workers.pipeline.host_copy import HostCopy
from fleetgen.workers.pipeline.load import load_pipeline
from fleetgen.workers.pipeline.segment import Segment, reclaim, segment_key
from tests.conftest import ROOT

MiB = 2**20


@pytest.fixture
def shm(tmp_path, monkeypatch):
    """This user's directory of segments (workers/pipeline/segment.py: `UserDir`) in a shared directory of
    this test's own (in /dev/shm where there is one); empty at the end."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    where = base / f"fleetgen-host-copy-{os.getpid()}-{time.monotonic_ns()}"
    where.mkdir()
    monkeypatch.setenv("FLEETGEN_SHM_DIR", str(where))
    mine = where / f"fleetgen-{os.geteuid()}"
    mine.mkdir(mode=0o700)
    yield mine
    shutil.rmtree(where)


def _load(model: str, mode: str = "node", tag: str = "w"):
    hc = HostCopy(mode, segment_key({"model": model, "dtype": "torch.float32"}), tag)
    return hc, hc.load(lambda given: load_pipeline(model, torch.float32, components=given))


def _image(pipe) -> bytes:
    out = pipe(
        "a red fox", num_inference_steps=2, height=32, width=32, output_type="np", generator=torch.manual_seed(3)
    )
    return out.images.tobytes()


def test_two_workers_map_one_copy_and_make_the_same_pixels(tiny_model, shm):
    """The first writes the segment and maps it; the second maps it and builds its modules from the
    manifest (loading no weights); both make the pixels a worker with its own copy makes, their weights
    are the same memory, and the last to leave removes the files."""
    first, a = _load(tiny_model)
    second, b = _load(tiny_model)
    _, own = _load(tiny_model, "worker")
    assert (first.segment.role, second.segment.role) == ("wrote", "mapped")
    assert second.built == sorted(first.shared) == ["text_encoder", "unet", "vae"]
    wa, wb = a.unet.conv_in.weight, b.unet.conv_in.weight
    assert wa.data_ptr() != wb.data_ptr() or True  # two mappings of one file: same pages, own addresses
    assert torch.equal(wa, own.unet.conv_in.weight) and torch.equal(wb, own.unet.conv_in.weight)
    assert _image(a) == _image(b) == _image(own)
    record = second.record(b)
    assert record["role"] == "mapped" and record["own_bytes"] == 0
    assert record["shared_bytes"] == sum(second.segment.bytes_of(n) for n in second.shared) > 0
    assert sorted(p.suffix for p in shm.iterdir()) == [".data", ".json", ".lock", ".users"]
    first.close()
    assert len(list(shm.iterdir())) == 4  # the second still maps it
    second.close()
    assert list(shm.iterdir()) == []


@pytest.mark.chaos  # worker processes killed (or faulting) for real
def test_a_worker_cannot_write_to_the_nodes_weights(tiny_model, shm):
    """The mapping is read-only: a worker that writes to its weights dies (SIGSEGV) instead of changing
    another's; the other's weights and pixels are as they were."""
    hc, pipe = _load(tiny_model)
    before = _image(pipe)
    code = (
        "import torch, sys\n"
        "from tests.workers.test_host_copy import _load\n"
        "hc, pipe = _load(sys.argv[1])\n"
        "assert hc.segment.role == 'mapped'\n"
        "print('mapped', flush=True)\n"
        "pipe.unet.conv_in.weight.data.add_(1.0)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, tiny_model], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert "mapped" in proc.stdout and proc.returncode == -signal.SIGSEGV, proc.stderr[-2000:]
    assert _image(pipe) == before
    hc.close()
    assert list(shm.iterdir()) == []


def _child_holding(model: str, stage: str) -> subprocess.Popen:
    """A process that loads `model` with the node's copy and then stops at `stage` (`mapped`: holding
    it; `writing`: in the middle of writing it, after its first component) until killed."""
    code = (
        "import sys, time\n"
        "from tests.workers.test_host_copy import _load\n"
        "from fleetgen.workers.pipeline import host_copy\n"
        "if sys.argv[2] == 'writing':\n"
        "    original = host_copy.HostCopy._bind\n"
        "    def stall(self, name, module):\n"
        "        original(self, name, module)\n"
        "        print('writing', flush=True)\n"
        "        time.sleep(600)\n"
        "    host_copy.HostCopy._bind = stall\n"
        "_load(sys.argv[1])\n"
        "print('mapped', flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, model, stage], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    line = proc.stdout.readline()
    assert line.strip() == stage, proc.stderr.read()[-2000:] if proc.poll() is not None else line
    return proc


def _kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stdout.close()
    proc.stderr.close()


@pytest.mark.chaos  # worker processes killed (or faulting) for real
def test_a_segment_whose_users_were_all_killed_is_reclaimed(tiny_model, shm):
    """SIGKILLed users leave their files; the next worker of any model reclaims them: of its own
    model by writing it afresh, of another by removing them. A segment still in use is left alone."""
    proc = _child_holding(tiny_model, "mapped")
    left = sorted(p.name for p in shm.iterdir())
    assert len(left) == 4
    assert reclaim(shm.parent) == []  # its user is alive
    _kill(proc)
    assert sorted(p.name for p in shm.iterdir()) == left  # a SIGKILL runs no exit handler

    other = Segment("another-model", shm.parent)  # a dead job's segment of another model
    with other.guard():
        other.join()
        other.write({"m": torch.nn.Linear(4, 4)})
    other.users_fd and os.close(other.users_fd)  # as a SIGKILL would: its lock gone, its files not
    hc, pipe = _load(tiny_model)
    assert hc.segment.role == "wrote"  # its own model's dead segment: written again
    assert not any("another-model" in p.name for p in shm.iterdir())
    hc.close()
    assert list(shm.iterdir()) == []


@pytest.mark.chaos  # worker processes killed (or faulting) for real
def test_a_half_written_segment_is_never_mapped(tiny_model, shm):
    """The writer SIGKILLed after its first component: no manifest, so the next worker does not map the
    partial data; it writes the segment whole, and its pixels are those of a copy of its own."""
    proc = _child_holding(tiny_model, "writing")
    assert not any(p.suffix == ".json" for p in shm.iterdir())
    _kill(proc)
    hc, pipe = _load(tiny_model)
    assert hc.segment.role == "wrote" and sorted(hc.shared) == ["text_encoder", "unet", "vae"]
    _, own = _load(tiny_model, "worker")
    assert _image(pipe) == _image(own)
    hc.close()
    assert list(shm.iterdir()) == []


@pytest.mark.chaos  # worker processes killed (or faulting) for real
def test_a_worker_that_dies_leaves_the_others_weights_whole(tiny_model, shm):
    """Of two users, the one that wrote the segment is SIGKILLed; the other's weights and pixels are
    unchanged, the files stay while it maps them, and go when it leaves."""
    proc = _child_holding(tiny_model, "mapped")
    hc, pipe = _load(tiny_model)
    assert hc.segment.role == "mapped"
    before = _image(pipe)
    _kill(proc)
    assert _image(pipe) == before and len(list(shm.iterdir())) == 4
    hc.close()
    assert list(shm.iterdir()) == []


def test_no_shared_memory_falls_back_to_a_copy_per_worker_with_its_line(tiny_model, tmp_path, monkeypatch, capsys):
    """A shared directory that is missing, or too small (a container's 64 MB /dev/shm: here a 1 MiB
    tmpfs, where this machine lets the test mount one): each worker keeps its own copy, says why and
    how to give it more, and makes the same pixels."""
    _, own = _load(tiny_model, "worker")
    monkeypatch.setenv("FLEETGEN_SHM_DIR", str(tmp_path / "missing"))
    hc, pipe = _load(tiny_model, tag="w3")
    line = capsys.readouterr().out
    assert "[fleetgen] w3: host copy per worker, not per node:" in line and "is missing or not writable" in line
    assert "FLEETGEN_SHM_DIR" in line and hc.record(pipe)["shared"] is False and "note" in hc.record(pipe)
    assert _image(pipe) == _image(own)

    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        monkeypatch.setenv("FLEETGEN_SHM_DIR", str(small))
        hc, pipe = _load(tiny_model, tag="w4")
        line = capsys.readouterr().out
        assert "[fleetgen] w4: host copy per worker, not per node:" in line and "free and the weights take" in line
        assert "--shm-size" in line  # the fix named
        assert _image(pipe) == _image(own)
        assert list((small / f"fleetgen-{os.geteuid()}").iterdir()) == []  # nothing half-written left
    finally:
        subprocess.run(["umount", str(small)], check=True)


def report(proc: subprocess.Popen) -> dict:
    """A host_copy_child's JSON line (after any line it says first: "waiting for another worker ...")."""
    for line in proc.stdout:
        if line.startswith("{"):
            return json.loads(line)
    raise AssertionError(f"no report: exit {proc.wait()}")


@pytest.mark.slow
def test_workers_of_a_node_hold_one_copy(tmp_path_factory, shm):
    """Processes of one node (forked from one that imported torch and diffusers once) loading the 85
    M-parameter model as workers do, at bfloat16 from its float32 files (163 MiB of weights, converted:
    each one's own) and making an image: one with `--host-copy worker` beside two at once with
    `--host-copy node`, then two more beside those (four at once, the first two measured again). Each one's
    own memory (RssAnon) is at least 70 % of the weights below the first's, with two and with four; each
    maps the one copy (RssShmem); the same pixels; nothing left in the shared directory. (Loaded as stored, safetensors weights are pages of the file mapped from the page cache,
    which the OS shares already on a CPU node; what multiplies per worker is a converted or a pinned copy.)"""
    from fleetgen.cli import main as cli
    from tests.workers.host_copy_child import forked

    model = tmp_path_factory.mktemp("small") / "model"
    assert cli(["tiny-model", "--size", "small", str(model)]) == 0

    def start(mode: str, n: int) -> list:
        return [forked(str(model), mode, "bfloat16", str(shm.parent)) for _ in range(n)]

    def leave(procs: list) -> None:
        for _, conn in procs:
            conn.send(None)
        for proc, conn in procs:
            proc.join(timeout=120)
            assert proc.exitcode == 0
            conn.close()

    (solo,) = start("worker", 1)  # its own copy: nothing in the shared directory, beside the first two
    first = start("node", 2)
    own = solo[1].recv()
    two = [conn.recv() for _, conn in first]  # both hold their pipelines until both have reported: a node's at once
    leave([solo])
    more = start("node", 2)
    later = [conn.recv() for _, conn in more]
    for _, conn in first:  # measured again with four at once
        conn.send(True)
    four = [conn.recv() for _, conn in first] + later
    leave(first + more)
    assert list(shm.iterdir()) == []  # the last to leave removed the copy
    assert own["host_copy"]["mode"] == "worker" and not own["host_copy"]["shared"]
    weights = two[0]["host_copy"]["shared_bytes"]
    assert 160 * MiB < weights < 170 * MiB  # the bfloat16 weights, once
    assert sorted(r["host_copy"]["role"] for r in two) == ["mapped", "wrote"]
    assert [r["host_copy"]["role"] for r in later] == ["mapped"] * 2  # the two already there hold the copy
    for node in (two, four):
        assert all(r["memory"]["shmem_bytes"] >= 0.95 * weights for r in node)  # each maps the one copy
        assert len({r["sha"] for r in [own, *node]}) == 1
        anon = [r["memory"]["anon_bytes"] // MiB for r in node]
        print(f"own memory: {own['memory']['anon_bytes'] // MiB} MiB with a copy, {anon} MiB with the node's")
        assert all(own["memory"]["anon_bytes"] - r["memory"]["anon_bytes"] >= 0.7 * weights for r in node), anon


@pytest.mark.gpu
def test_a_registered_mapping_copies_to_the_device_at_pinned_speed(shm):
    """On CUDA: a 512 MiB weight in the node's segment, registered in place, reads as pinned and copies
    to the device within 10 % of a private pinned copy's rate; unregistered when its worker leaves."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    seg = Segment("gpu-rate", shm.parent)
    module = torch.nn.Linear(16384, 16384, bias=False).to(torch.bfloat16)
    with seg.guard():
        seg.join()
        seg.write({"m": module})
    seg.map()
    view = seg.views("m")["weight"][1]
    assert not view.is_pinned()
    assert seg.register(["m"]) >= view.numel() * 2 and view.is_pinned(), seg.register_note
    private = torch.empty_like(view).pin_memory()
    target = torch.empty_like(view, device="cuda")

    def rate(src) -> float:
        target.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(5):
            target.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        return 5 * src.numel() * src.element_size() / (time.perf_counter() - started)

    shared, own = rate(view), rate(private)
    print(f"host→device: registered shared mapping {shared / 1e9:.1f} GB/s, private pinned {own / 1e9:.1f} GB/s")
    assert abs(shared / own - 1) <= 0.10
    del view, private
    seg.leave()
    assert not seg.registered and list(shm.iterdir()) == []


@pytest.mark.gpu
def test_a_streamed_component_streams_from_the_nodes_copy_on_cuda(shm):
    """On CUDA: the tiny FLUX's transformer at leaf level with streams, its weights in the node's segment
    and registered there: group offloading keeps no pinned copy of its own (its host tensors are views of
    the mapping), and the latents are those of a pipeline with its own copy."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from fleetgen.offload import OffloadPlan, Placement, apply, profile_pipeline
    from fleetgen.offload.hooks import unapply
    from fleetgen.workers.tiny.flux import build_tiny_flux
    from tests.offload.test_gpu import latents

    plan = OffloadPlan({"transformer": Placement("leaf", stream=True)}, 1)
    own = build_tiny_flux()
    own.set_progress_bar_config(disable=True)
    placed = apply(own, plan, profile_pipeline(own), torch.device("cuda"))
    reference = latents(own).cpu()
    unapply(own, placed)

    hc = HostCopy("node", "gpu-stream", "w")
    pipe = hc.load(lambda given: build_tiny_flux())
    pipe.set_progress_bar_config(disable=True)
    hc.pin(plan)
    assert "transformer" in hc.pinned, hc.segment.register_note
    placed = apply(pipe, plan, profile_pipeline(pipe), torch.device("cuda"))
    start = hc.segment._base.data_ptr()
    end = start + hc.segment.manifest["total"]
    hosts = [
        t
        for m in pipe.transformer.modules()
        for hook in getattr(getattr(m, "_diffusers_hook", None), "hooks", {}).values()
        for t in getattr(getattr(hook, "group", None), "cpu_param_dict", {}).values()
    ]
    assert hosts and all(start <= t.data_ptr() < end for t in hosts)  # no private pinned copy
    assert torch.equal(latents(pipe).cpu(), reference)
    unapply(pipe, placed)
    hc.close()
    assert list(shm.iterdir()) == []

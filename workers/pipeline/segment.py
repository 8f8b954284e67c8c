"""A node's shared segment of weights (`--host-copy node`, workers/pipeline/host_copy.py uses it): its files,
its layout, its membership — written once, mapped read-only, counted by its users, reclaimed when they are
all gone. (Binding a pipeline's modules to it is host_copy.py's.)

The files of the segment with key K in the directory D:
- D/fleetgen-K.lock: the guard. Creating, joining, leaving and reclaiming all happen while a worker
  holds it exclusively, and each of these is short, except the writer's one write.
- D/fleetgen-K.users: each user holds a shared `flock` on it while it maps the segment. The kernel drops
  the lock when its holder exits, even under SIGKILL, so "no users" means that no live process holds it.
- D/fleetgen-K.data: the tensors' bytes.
- D/fleetgen-K.json: the manifest. It is renamed into place only after the data is whole, so a segment
  without one (its writer died) is never mapped.

A worker that joins a segment with no live users removes whatever that segment left. It also removes any
other segment in D that has no live users (SIGKILLed workers, a lost job). The last worker to leave
removes the files. Where D is missing or too small (a container's /dev/shm defaults to 64 MB), each
worker keeps its own copy and says so in one line that names the fix.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import mmap
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fleetgen.offload.devices import host_available_bytes
from fleetgen.units import format_size

PREFIX = "fleetgen-"
ALIGN = 64  # bytes: every tensor starts at a multiple (and so at one of its element size)
PAGE = 4096
CHUNK = 64 << 30  # at most this many bytes a `cudaHostRegister` call (one call fails at 512 GiB and more)
SHM_HINT = (
    "give the node more shared memory: `docker run --shm-size=...`, on Kubernetes an emptyDir of medium "
    "Memory mounted at /dev/shm, or set FLEETGEN_SHM_DIR to a larger tmpfs"
)


def shm_dir() -> Path:
    return Path(os.environ.get("FLEETGEN_SHM_DIR", "/dev/shm"))


def segment_key(parts: dict) -> str:
    """The segment of a model: its source, revision and variant, the weights' own files (size and
    time of each, for a local directory), the run dtype, the formats applied at load, and the versions
    that shape the tensors."""
    import diffusers

    from fleetgen import __version__

    model = parts.get("model", "")
    files = []
    if model and Path(model).is_dir():
        for path in sorted(Path(model).rglob("*")):
            if path.is_file() and path.suffix in (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".json"):
                st = path.stat()
                files.append((str(path.relative_to(model)), st.st_size, st.st_mtime_ns))
        model = str(Path(model).resolve())
    versions = (__version__, str(torch.__version__), diffusers.__version__)
    raw = json.dumps([{**parts, "model": model}, files, versions], sort_keys=True, default=str)
    return hashlib.sha256(raw.encode()).hexdigest()[:20]


def tensors(module: torch.nn.Module):
    """(qualified name, is a parameter, tensor) of every parameter and buffer, tied ones under each name."""
    for name, p in module.named_parameters(remove_duplicate=False):
        yield name, True, p
    for name, b in module.named_buffers(remove_duplicate=False):
        if b is not None:
            yield name, False, b


def shareable(module) -> bool:
    """A module whose tensors can live in the segment as they are: plain parameters and tensors on the
    CPU (not a quantized format's tensor subclasses, not meta), in a fixed layout."""
    if not isinstance(module, torch.nn.Module):
        return False
    seen = False
    for _, is_param, t in tensors(module):
        seen = True
        if type(t) is not (torch.nn.Parameter if is_param else torch.Tensor) or type(t.data) is not torch.Tensor:
            return False
        if t.device.type != "cpu" or t.is_sparse or t.layout != torch.strided:
            return False
    return seen


@dataclass
class Layout:
    """Where each tensor lies in the data file: per component, (name, is a parameter, entry) and the
    entries (offset, bytes, dtype, shape; tied tensors share one); the page-aligned ranges to register."""

    components: dict[str, dict] = field(default_factory=dict)
    total: int = 0


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


def layout(modules: dict[str, torch.nn.Module]) -> tuple[Layout, dict[int, torch.Tensor]]:
    """The segment's layout for `modules`, and {entry index: the tensor whose bytes fill it}. Each
    component starts at a page; each registration chunk too (a chunk holds whole tensors)."""
    out, sources, offset, index = Layout(), {}, 0, 0
    for comp, module in sorted(modules.items()):
        offset = _align(offset, PAGE)
        start = chunk_start = offset
        ids: dict[tuple, int] = {}
        entries, names, chunks = [], [], []
        for name, is_param, t in tensors(module):
            ident = (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))
            if ident not in ids:
                nbytes = t.numel() * t.element_size()
                if offset + nbytes - chunk_start > CHUNK and offset > chunk_start:
                    offset = _align(offset, PAGE)
                    chunks.append([chunk_start, offset])
                    chunk_start = offset
                ids[ident] = len(entries)
                entries.append({"offset": offset, "bytes": nbytes, "dtype": str(t.dtype)[6:], "shape": list(t.shape)})
                sources[index + ids[ident]] = t
                offset = _align(offset + nbytes, ALIGN)
            names.append([name, is_param, ids[ident]])
        end = _align(offset, PAGE)
        chunks.append([chunk_start, end])
        out.components[comp] = {
            "class": f"{type(module).__module__}.{type(module).__qualname__}",
            "config": _config_of(module),
            "entries": entries,
            "names": names,
            "first": index,
            "range": [start, end],
            "chunks": chunks,
        }
        index += len(entries)
        offset = end
    out.total = offset
    return out, sources


def _config_of(module) -> dict | None:
    """What rebuilds the module without its weights: a diffusers model's config, or a transformers
    model's (with its class); None where neither (the follower loads it as the writer did)."""
    config = getattr(module, "config", None)
    if config is None:
        return None
    try:
        if hasattr(config, "to_dict"):  # transformers
            kind = f"{type(config).__module__}.{type(config).__qualname__}"
            return {"transformers": kind, "values": json.loads(json.dumps(config.to_dict(), default=str))}
        return {"diffusers": json.loads(json.dumps(dict(config), default=str))}
    except (TypeError, ValueError):
        return None


class Unavailable(Exception):
    """The node cannot hold a shared copy here (the reason is the message); the worker keeps its own."""


class Segment:
    """One worker's membership of a node's segment: joined (`join`), written by the first (`write`),
    mapped read-only (`views`), left once (`leave`)."""

    def __init__(self, key: str, where: Path | None = None):
        self.key, self.dir = key, where or shm_dir()
        base = self.dir / f"{PREFIX}{key}"
        self.paths = {k: Path(f"{base}.{k}") for k in ("lock", "users", "data", "json")}
        self.users_fd: int | None = None
        self.manifest: dict | None = None
        self.role = "mapped"
        self._mm: mmap.mmap | None = None
        self._base: torch.Tensor | None = None
        self.registered: list[tuple[int, int]] = []
        self.register_note: str | None = None
        self.waiting: str | None = None  # said when another worker holds the guard (writing the copy)

    # -- membership -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def guard(self):
        """The segment's guard, held exclusively; reopened where the file it locked was removed meanwhile."""
        try:
            import fcntl
        except ImportError:
            raise Unavailable("this platform has no flock") from None
        if not self.dir.is_dir() or not os.access(self.dir, os.W_OK):
            raise Unavailable(f"{self.dir} is missing or not writable")
        while True:
            fd = os.open(self.paths["lock"], os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if self.waiting:
                    print(self.waiting, flush=True)
                fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                same = os.fstat(fd).st_ino == os.stat(self.paths["lock"]).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        try:
            yield
        finally:
            os.close(fd)  # closing drops the lock

    def join(self) -> bool:
        """Become a user; under the guard (the caller holds it). True when the segment is whole (map it),
        False when this worker is to write it (whatever an earlier, dead writer left is removed)."""
        import fcntl

        reclaim(self.dir, skip=self.key)
        fd = os.open(self.paths["users"], os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            alone = True
        except BlockingIOError:
            alone = False
        if alone:  # no live user: what is there is a dead writer's or a finished job's
            for k in ("json", "data"):
                self.paths[k].unlink(missing_ok=True)
        fcntl.flock(fd, fcntl.LOCK_SH)
        self.users_fd = fd
        if self.paths["json"].exists():
            self.manifest = json.loads(self.paths["json"].read_text())
            return True
        self.role = "wrote"
        return False

    def write(self, modules: dict[str, torch.nn.Module], written=None) -> None:
        """Write `modules`' tensors, component by component, and then the manifest (under the guard);
        `written(name)` after each component (the writer binds it to the mapping at once, so that its
        own copy goes while the next is written: it never holds much more than one copy). Unavailable
        where the directory has too little room; nothing half-written is left behind."""
        plan, sources = layout(modules)
        st = os.statvfs(self.dir)
        free = st.f_bavail * st.f_frsize
        if plan.total > free:
            raise Unavailable(f"{self.dir} has {format_size(free)} free and the weights take {format_size(plan.total)}")
        # written a component at a time, each freed from this worker's own copy once written: beside what is
        # loaded, the largest component at once
        largest = max((c["range"][1] - c["range"][0] for c in plan.components.values()), default=0)
        try:
            available = host_available_bytes()
        except OSError:  # no /proc/meminfo
            available = None
        if available is not None and largest > available:
            raise Unavailable(
                f"host RAM has {format_size(available)} available and writing the node's copy beside this "
                f"worker's load needs {format_size(largest)}"
            )
        started = time.perf_counter()
        self.manifest = {"key": self.key, "total": plan.total, "components": plan.components, "writer": os.getpid()}
        try:
            fd = os.open(self.paths["data"], os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.ftruncate(fd, plan.total)
                self.map()
                for name, comp in plan.components.items():
                    for i, e in enumerate(comp["entries"]):
                        raw = sources[comp["first"] + i].detach().contiguous().reshape(-1).view(torch.uint8).numpy()
                        view, offset = memoryview(raw), e["offset"]
                        while view:  # pwrite may write less than asked
                            n = os.pwrite(fd, view, offset)
                            view, offset = view[n:], offset + n
                    if written is not None:
                        written(name)
            finally:
                os.close(fd)
        except OSError as err:
            self.paths["data"].unlink(missing_ok=True)
            if err.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                raise Unavailable(f"{self.dir} ran out of room writing {format_size(plan.total)}") from None
            raise
        self.manifest["write_seconds"] = round(time.perf_counter() - started, 3)
        tmp = self.paths["json"].with_suffix(f".json.{os.getpid()}")
        tmp.write_text(json.dumps(self.manifest))
        os.replace(tmp, self.paths["json"])

    def map(self) -> None:
        """Map the data read-only (a worker that writes to its weights faults instead of changing the others')."""
        if self._mm is not None:
            return
        fd = os.open(self.paths["data"], os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size != self.manifest["total"]:
                raise Unavailable(
                    f"{self.paths['data']} holds {size} bytes, its manifest says {self.manifest['total']}"
                )
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        with warnings.catch_warnings():  # "the given buffer is not writable": it is meant not to be
            warnings.simplefilter("ignore", UserWarning)
            self._base = torch.frombuffer(self._mm, dtype=torch.uint8)

    def views(self, component: str) -> dict[str, tuple[bool, torch.Tensor]]:
        """{qualified name: (is a parameter, its view into the mapping)}; tied names share one view."""
        comp = self.manifest["components"][component]
        made = []
        for e in comp["entries"]:
            raw = self._base[e["offset"] : e["offset"] + e["bytes"]]
            made.append(raw.view(getattr(torch, e["dtype"])).view(e["shape"]))
        return {name: (is_param, made[i]) for name, is_param, i in comp["names"]}

    def bytes_of(self, component: str) -> int:
        return sum(e["bytes"] for e in self.manifest["components"][component]["entries"])

    # -- CUDA: pinned in place ----------------------------------------------------------------------
    def register(self, components) -> int:
        """Page-lock the ranges of `components` for this process's copies to the device (in chunks);
        the bytes registered. A refusal leaves them pageable: group offloading then pins its own copy."""
        if self._mm is None or not torch.cuda.is_available():
            return 0
        cudart = torch.cuda.cudart()
        base = self._base.data_ptr()
        read_only = 8  # cudaHostRegisterReadOnly: the mapping is PROT_READ
        done = 0
        for name in components:
            for start, end in self.manifest["components"][name]["chunks"]:
                end = min(end, self.manifest["total"])
                if end <= start:
                    continue
                err = cudart.cudaHostRegister(base + start, end - start, read_only)
                code = int(getattr(err, "value", err))
                if code != 0:
                    self.register_note = f"cudaHostRegister refused {format_size(end - start)} (error {code})"
                    return done
                self.registered.append((base + start, end - start))
                done += end - start
        return done

    def unregister(self) -> None:
        if self.registered:
            cudart = torch.cuda.cudart()
            for ptr, _ in self.registered:
                cudart.cudaHostUnregister(ptr)
            self.registered = []

    def leave(self) -> None:
        """Stop being a user: unregister, unmap where nothing holds a view any more, drop the users' lock,
        and, the last to go, remove the files."""
        import fcntl

        if self.users_fd is None:
            return
        self.unregister()
        self._base = None
        if self._mm is not None:
            with contextlib.suppress(BufferError):  # views still held: the mapping goes with the process
                self._mm.close()
            self._mm = None
        with self.guard():
            fd, self.users_fd = self.users_fd, None
            fcntl.flock(fd, fcntl.LOCK_UN)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                last = True
            except BlockingIOError:
                last = False
            if last:
                for k in ("json", "data", "users", "lock"):
                    self.paths[k].unlink(missing_ok=True)
            os.close(fd)


def reclaim(where: Path, skip: str | None = None) -> list[str]:
    """Remove every segment in `where` that no live process uses (its users all died, or a job was
    killed); those another worker is busy with are left alone. The keys removed."""
    import fcntl

    removed = []
    for users in where.glob(f"{PREFIX}*.users"):
        key = users.name[len(PREFIX) : -len(".users")]
        if key == skip:
            continue
        seg = Segment(key, where)
        try:
            lock = os.open(seg.paths["lock"], os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:
            continue
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock)
            continue  # being written, joined or left right now: live
        try:
            fd = os.open(users, os.O_RDWR)
        except FileNotFoundError:
            os.close(lock)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            for k in ("json", "data", "users", "lock"):
                seg.paths[k].unlink(missing_ok=True)
            removed.append(key)
        except BlockingIOError:
            pass
        finally:
            os.close(fd)
            os.close(lock)
    return removed

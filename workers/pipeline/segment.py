"""A node's shared segment of weights (`--host-copy node`, workers/pipeline/host_copy.py uses it): its files,
its layout, its membership — written once, sealed, mapped read-only, counted by its users, reclaimed when
they are all gone. (Binding a pipeline's modules to it is host_copy.py's.)

Shared memory is shared with every user of the node, so nothing found there is trusted until checked:
- The segments of a user live in that user's own directory (workers/pipeline/user_dir.py), B/fleetgen-UID (B: /dev/shm or
  FLEETGEN_SHM_DIR), created mode 0700 and opened once without following links; it is used only when
  `fstat` says it is a directory of this user's with mode 0700, and every file in it is opened relative to
  that open directory, `O_NOFOLLOW`, and used only when it is a regular file of this user's. Another user
  can neither read nor replace what is in it; a directory this user cannot own (another user made it first,
  a link) falls back to a copy per worker with one line naming why and the fix.
- The data file is created exclusively and its whole size reserved (`posix_fallocate`) before a byte is
  written: a directory without room refuses at once (ENOSPC), never with a SIGBUS later.
- The manifest is the seal: renamed into place after every byte is written, and a worker maps a segment
  only when the manifest is its user's, sealed, and of the key the worker computed for itself.
- A mapping is never unmapped under live views: the tensors built on it hold the mapping, which goes when
  the last of them does (a worker leaving drops its lock and its files, not the memory its modules use).
- Waits on another process (the writer holding the guard) end after FLEETGEN_HOST_COPY_WAIT seconds
  (default 900), saying whom they waited for; the worker then keeps its own copy.

The files of the segment with key K in this user's directory D:
- D/fleetgen-K.lock: the guard. Creating, joining, leaving and reclaiming all happen while a worker
  holds it exclusively, and each of these is short, except the writer's one write. Its holder writes
  what it does into it, which a waiting worker prints.
- D/fleetgen-K.users: each user holds a shared `flock` on it while it maps the segment. The kernel drops
  the lock when its holder exits, even under SIGKILL, so "no users" means that no live process holds it.
- D/fleetgen-K.data: the tensors' bytes.
- D/fleetgen-K.json: the manifest, the seal.

A worker that joins a segment with no live users removes whatever that segment left. It also removes any
other segment in D that has no live users (SIGKILLed workers, a lost job); a job's driver at its end and a
Ray Data stage at its end do the same on every node that ran their workers (`reclaim`). The last worker to
leave removes the files. Where D is missing or too small (a container's /dev/shm defaults to 64 MB), each
worker keeps its own copy and says so in one line that names the fix.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fleetgen.offload.devices import host_available_bytes, node_copy_refusal
from fleetgen.units import format_size
from fleetgen.workers.pipeline.user_dir import (
    PREFIX,
    Unavailable,
    UserDir,
    read_all,
    reclaim,
    seals,
    segment_files,
    shm_dir,
)

ALIGN = 64  # bytes: every tensor starts at a multiple (and so at one of its element size)
PAGE = 4096
CHUNK = 64 << 30  # at most this many bytes a `cudaHostRegister` call (one call fails at 512 GiB and more)
SHM_HINT = (
    "give the node more shared memory: `docker run --shm-size=...`, on Kubernetes an emptyDir of medium "
    "Memory mounted at /dev/shm, or set FLEETGEN_SHM_DIR to a larger tmpfs"
)


WAIT = 900.0  # seconds a worker waits for another holding a segment's guard (a writer loading, downloading)
SAY_EVERY = 60.0  # seconds between a waiting worker's lines


def wait_limit() -> float:
    try:
        return float(os.environ.get("FLEETGEN_HOST_COPY_WAIT", WAIT))
    except ValueError:
        return WAIT


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


class Segment:
    """One worker's membership of a node's segment: joined (`join`), written by the first (`write`),
    mapped read-only (`views`), left once (`leave`)."""

    def __init__(self, key: str, base: Path | None = None):
        self.key, self.base = key, base
        self.names = segment_files(key)
        self.home: UserDir | None = None
        self.users_fd: int | None = None
        self.manifest: dict | None = None
        self.role = "mapped"
        self._mm: mmap.mmap | None = None
        self._base: torch.Tensor | None = None
        self.registered: list[tuple[int, int]] = []
        self.register_note: str | None = None
        self.waiting: str | None = None  # said when another worker holds the guard (writing the copy)

    @property
    def paths(self) -> dict[str, Path]:
        where = self.home.path if self.home else (self.base or shm_dir()) / f"{PREFIX}{os.geteuid()}"
        return {k: where / name for k, name in self.names.items()}

    # -- membership -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def guard(self, doing: str = "joining"):
        """The segment's guard, held exclusively (reopened where the file it locked was removed meanwhile),
        waiting at most `wait_limit()` seconds for another holder; its holder's `doing` written in it."""
        import importlib.util

        if importlib.util.find_spec("fcntl") is None:
            raise Unavailable("this platform has no flock")
        if self.home is None:
            self.home = UserDir(self.base)
        while True:
            fd = self.home.open(self.names["lock"], os.O_RDWR | os.O_CREAT)
            if not self._lock(fd):
                holder = read_all(fd).decode(errors="replace").strip() or "another worker"
                os.close(fd)
                raise Unavailable(f"waited {wait_limit():g} s for {holder}")
            try:
                same = os.fstat(fd).st_ino == os.stat(self.names["lock"], dir_fd=self.home.fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        try:
            self.say(fd, doing)
            yield fd
        finally:
            os.close(fd)  # closing drops the lock

    def _lock(self, fd: int) -> bool:
        """The guard's exclusive lock, within the wait limit; a waiting worker says whom it waits for."""
        import fcntl

        started, said = time.monotonic(), None
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                pass
            now = time.monotonic()
            if now - started >= wait_limit():
                return False
            if self.waiting and (said is None or now - said >= SAY_EVERY):
                holder = read_all(fd).decode(errors="replace").strip() or "another worker"
                print(f"{self.waiting} ({holder}; {now - started:.0f} s so far)", flush=True)
                said = now
            time.sleep(0.05 if now - started < 1 else 0.5)

    @staticmethod
    def say(fd: int, doing: str) -> None:
        """What the guard's holder does, for the workers that wait on it (where the directory has room to say it)."""
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} {doing}".encode(), 0)

    def join(self) -> bool:
        """Become a user; under the guard (the caller holds it). True when the segment is whole and sealed
        (map it), False when this worker is to write it (whatever an earlier writer left is removed)."""
        import fcntl

        reclaim(self.home, skip=self.key)
        fd = self.home.open(self.names["users"], os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            alone = True
        except BlockingIOError:
            alone = False
        if alone:  # no live user: what is there is a dead writer's or a finished job's
            self.home.remove(self.names["json"], self.names["data"])
        fcntl.flock(fd, fcntl.LOCK_SH)
        self.users_fd = fd
        self.manifest = self._sealed()
        if self.manifest is not None:
            return True
        self.home.remove(self.names["json"], self.names["data"], *self.seals())  # unsealed or not its key: never mapped
        self.role = "wrote"
        return False

    def seals(self) -> list[str]:
        """The seals being written (or left by dead writers) of this segment."""
        return seals(self.home, self.key)

    def _sealed(self) -> dict | None:
        """The manifest where it is this user's, sealed and of this worker's key; else None."""
        try:
            fd = self.home.open(self.names["json"], os.O_RDONLY)
        except Unavailable:
            return None
        try:
            manifest = json.loads(read_all(fd))
        except ValueError:
            return None
        finally:
            os.close(fd)
        ok = isinstance(manifest, dict) and manifest.get("sealed") is True and manifest.get("key") == self.key
        return manifest if ok and isinstance(manifest.get("total"), int) else None

    def write(self, modules: dict[str, torch.nn.Module], written=None) -> None:
        """Write `modules`' tensors, component by component, and then the manifest (under the guard);
        `written(name)` after each component (the writer binds it to the mapping at once, so that its
        own copy goes while the next is written: it never holds much more than one copy). The whole size
        is reserved first. Unavailable where the directory has too little room or a write fails (whatever
        `written` bound is then the caller's to take back); nothing half-written is left behind."""
        plan, sources = layout(modules)
        self._check_room(plan)
        started = time.perf_counter()
        self.manifest = {"key": self.key, "total": plan.total, "components": plan.components, "writer": os.getpid()}
        tmp = f"{self.names['json']}.tmp-{os.getpid()}"
        self.home.remove(tmp, self.names["data"])
        seal = self.home.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL)
        fd = None
        try:
            # every page of the data and of the seal now, or ENOSPC now (never SIGBUS, nor a seal unwritable, later)
            reserve = [(seal, len(json.dumps({**self.manifest, "write_seconds": 1e9, "sealed": True})))]
            fd = self.home.open(self.names["data"], os.O_RDWR | os.O_CREAT | os.O_EXCL)
            reserve.append((fd, plan.total))
            try:
                for f, size in reserve:
                    if size:
                        os.posix_fallocate(f, 0, size)
            except OSError as err:
                raise Unavailable(
                    f"{self.home.path} could not reserve {format_size(plan.total)} ({err.strerror})"
                ) from None
            self.map()
            _fill(fd, plan, sources, written)
            self.manifest["write_seconds"] = round(time.perf_counter() - started, 3)
            self.manifest["sealed"] = True  # written last, after every byte: what a follower maps
            body = json.dumps(self.manifest).encode()
            os.pwrite(seal, body, 0)  # into its reserved pages
            os.ftruncate(seal, len(body))
        except OSError as err:
            self.home.remove(self.names["data"], tmp)
            raise Unavailable(f"writing {self.home.path / self.names['data']} failed ({err.strerror})") from None
        except BaseException:
            self.home.remove(self.names["data"], tmp)
            raise
        finally:
            os.close(seal)
            if fd is not None:
                os.close(fd)
        os.replace(tmp, self.names["json"], src_dir_fd=self.home.fd, dst_dir_fd=self.home.fd)

    def _check_room(self, plan: Layout) -> None:
        """Unavailable where the directory has less room than the weights take, or the host too little
        memory for the largest component beside what is loaded (written a component at a time, each
        freed from this worker's own copy once written), as the planner asks (`node_copy_refusal`)."""
        st = os.fstatvfs(self.home.fd)
        free = st.f_bavail * st.f_frsize
        if plan.total > free:
            raise Unavailable(
                f"{self.home.path} has {format_size(free)} free and the weights take {format_size(plan.total)}"
            )
        largest = max((c["range"][1] - c["range"][0] for c in plan.components.values()), default=0)
        try:
            available = host_available_bytes()
        except OSError:  # no /proc/meminfo
            return
        why = node_copy_refusal(0, largest, available)
        if why:
            raise Unavailable(why)

    def map(self) -> None:
        """Map the data read-only (a worker that writes to its weights faults instead of changing the others')."""
        if self._mm is not None:
            return
        fd = self.home.open(self.names["data"], os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size != self.manifest["total"]:
                raise Unavailable(
                    f"{self.paths['data']} holds {size} bytes, its manifest says {self.manifest['total']}"
                )
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ) if size else None
        finally:
            os.close(fd)
        with warnings.catch_warnings():  # "the given buffer is not writable": it is meant not to be
            warnings.simplefilter("ignore", UserWarning)
            self._base = torch.frombuffer(self._mm, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)

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
        """Stop being a user: unregister, drop this worker's hold on the mapping (the mapping itself lasts as
        long as a tensor built on it: never unmapped under a module still bound to it), drop the users'
        lock and, the last to go, remove the files."""
        import fcntl

        if self.users_fd is None:
            if self.home is not None:
                self.home.close()
            return
        self.unregister()
        self._base = self._mm = None  # not closed: the views hold the mapping, which goes with the last of them
        fd, self.users_fd = self.users_fd, None
        try:
            with self.guard("leaving"):
                fcntl.flock(fd, fcntl.LOCK_UN)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    last = True
                except BlockingIOError:
                    last = False
                if last:
                    self.home.remove(*(self.names[k] for k in ("json", "data", "users", "lock")), *self.seals())
        except Unavailable:  # the guard not had in time: the files stay for the next worker's or a driver's reclaim
            pass
        finally:
            os.close(fd)
            self.home.close()


def _fill(fd: int, plan: Layout, sources: dict[int, torch.Tensor], written=None) -> None:
    """Every tensor's bytes at its offset in the reserved data file, component by component;
    `written(name)` after each."""
    for name, comp in plan.components.items():
        for i, e in enumerate(comp["entries"]):
            raw = sources[comp["first"] + i].detach().contiguous().reshape(-1).view(torch.uint8).numpy()
            view, offset = memoryview(raw), e["offset"]
            while view:  # pwrite may write less than asked
                n = os.pwrite(fd, view, offset)
                view, offset = view[n:], offset + n
        if written is not None:
            written(name)

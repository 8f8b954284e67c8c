"""One host copy of the weights per node (`--host-copy node`): the first worker on a node to load a
model writes its weights into a segment in node-shared memory (/dev/shm: workers/pipeline/segment.py), and
every worker of that model on the node, the writer included, maps that segment read-only. Each worker's
parameters and buffers then point into the mapping, so the node holds one copy instead of one per worker.
Group offloading's host tensors are these same views. On CUDA each worker registers the ranges it streams
from (`cudaHostRegister`, in chunks, undone when it leaves), so its copies to the device run at pinned
speed without a private pinned copy. Where the node cannot hold a shared copy, each worker keeps its own
and says so in one line that names the fix.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch

from fleetgen.workers.pipeline.segment import SHM_HINT, Segment, Unavailable, shareable, tensors
from fleetgen.workers.pipeline.user_dir import PRIVATE_HINT


# -- binding a pipeline's modules to the mapping ------------------------------------------------------
def bind(module: torch.nn.Module, views: dict[str, tuple[bool, torch.Tensor]]) -> None:
    """Point every parameter and buffer of `module` at its view. Parameters keep their identity (and
    so their ties); a parameter still on `meta` (a module built without weights) gets one Parameter
    per view, shared by the names tied to it."""
    made: dict[int, torch.nn.Parameter] = {}
    for name, (is_param, view) in views.items():
        owner_name, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        if is_param:
            current = owner._parameters[leaf]
            if current is not None and current.device.type != "meta":
                current.data = view
            else:
                param = made.get(id(view))
                if param is None:
                    param = made[id(view)] = torch.nn.Parameter(view, requires_grad=False)
                owner._parameters[leaf] = param
        else:
            owner._buffers[leaf] = view


def build(component: dict) -> torch.nn.Module | None:
    """A module of the manifest's class and config, its parameters on `meta` (buffers as its
    constructor makes them; `bind` replaces them all). None where the manifest cannot say how."""
    import importlib

    config = component.get("config")
    if not config:
        return None
    modname, _, qual = component["class"].rpartition(".")
    cls = getattr(importlib.import_module(modname), qual)
    from accelerate import init_empty_weights

    with init_empty_weights():
        if "diffusers" in config:
            module = cls.from_config(config["diffusers"])
        else:
            cmod, _, cqual = config["transformers"].rpartition(".")
            ccls = getattr(importlib.import_module(cmod), cqual)
            module = cls._from_config(ccls.from_dict(config["values"]))
    return module.eval().requires_grad_(False)


def process_memory() -> dict:
    """This process's resident memory by kind (Linux /proc/self/status): `anon_bytes` its own (RssAnon:
    a copy of weights it converted or pinned is here), `file_bytes` mapped files (RssFile: weights loaded
    as stored, safetensors mapped from the page cache, which the node's processes share), `shmem_bytes`
    shared memory (RssShmem: the node's segment, mapped). Empty where there is no /proc."""
    names = {"RssAnon:": "anon_bytes", "RssFile:": "file_bytes", "RssShmem:": "shmem_bytes"}
    out = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            key = line.split(None, 1)[0] if line else ""
            if key in names:
                out[names[key]] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


# -- a worker's host copy -----------------------------------------------------------------------------
def _matches(module: torch.nn.Module, views: dict[str, tuple[bool, torch.Tensor]]) -> bool:
    """The module holds exactly the tensors the segment has (names, shapes, dtypes): bound, it computes
    what it computed with its own."""
    own = {name: t for name, _, t in tensors(module)}
    return own.keys() == views.keys() and all(
        own[n].shape == v.shape and own[n].dtype == v.dtype for n, (_, v) in views.items()
    )


def _trim() -> None:
    """Give the freed private copies back to the system (glibc keeps freed heap for reuse otherwise)."""
    import ctypes
    import ctypes.util

    with contextlib.suppress(OSError, AttributeError, TypeError):
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)


class HostCopy:
    """Where one worker's host copy of the weights lives (`--host-copy`), and what its record says:
    `node` — the node's shared segment, mapped (components whose tensors are plain; a quantized one
    stays the worker's own) — or `worker`, the worker's own copy."""

    def __init__(self, mode: str, key: str | None, tag: str = "worker"):
        self.mode, self.key, self.tag = mode, key, tag
        self.segment: Segment | None = None
        self.shared: dict[str, torch.nn.Module] = {}  # component: module bound to the segment
        self.built: list[str] = []  # components a follower built from the manifest (loaded nothing)
        self.note: str | None = None
        self.seconds = 0.0
        self.pinned: set[str] = set()  # components registered for this process's copies (CUDA)
        self.released: list[str] = []  # components it mapped, then held on the device for good (`settle`)

    def load(self, load, skip: set[str] = frozenset()):
        """The pipeline, by `load(components)` (`from_pretrained` with those modules given), its plain
        components bound to the node's segment: written by this worker where it is the first, else
        mapped, their modules built from the manifest without loading their weights. `skip`: components
        kept the worker's own (formats applied at load)."""
        if self.mode != "node" or self.key is None:
            return load(None)
        started = time.perf_counter()
        seg, pipe = Segment(self.key), None
        seg.waiting = (
            f"[fleetgen] {self.tag}: waiting for another worker on this node to write the node's copy of the weights"
        )
        try:
            with seg.guard() as guard:
                whole = seg.join()
                if not whole:
                    Segment.say(guard, "loading the model to write the node's copy of the weights")
                    pipe = load(None)
                    modules = {n: m for n, m in _modules(pipe).items() if n not in skip and shareable(m)}
                    self.segment = seg
                    Segment.say(guard, "writing the node's copy of the weights")
                    try:
                        seg.write(modules, written=lambda name: self._bind(name, modules[name]))
                    except BaseException:
                        self._own()  # what was bound to the half-written mapping: this worker's own again
                        raise
                    _trim()
            seg.map()
        except Unavailable as why:
            self.shared, self.segment = {}, None
            seg.leave()
            self.note = f"each worker keeps its own copy: {why}; {_hint(str(why))}"
            print(f"[fleetgen] {self.tag}: host copy per worker, not per node: {why} ({_hint(str(why))})", flush=True)
            return pipe if pipe is not None else load(None)
        except BaseException:
            self.shared, self.segment = {}, None
            seg.leave()
            raise
        self.segment = seg
        try:
            if pipe is None:
                built = {}
                for name, comp in seg.manifest["components"].items():
                    try:
                        module = build(comp)
                    except Exception:  # noqa: BLE001 - a class its manifest cannot rebuild: loaded from disk
                        module = None
                    if module is not None:
                        bind(module, seg.views(name))
                        built[name] = module
                self.built = sorted(built)
                pipe = load(built)
            self.rebind(pipe)
        except BaseException:
            self.close()
            raise
        _trim()
        self.seconds = time.perf_counter() - started
        return pipe

    def _own(self) -> None:
        """Every component bound to the segment given private copies of its tensors (ties kept): the
        worker goes on with its own copy where the node's could not be finished."""
        for module in self.shared.values():
            copies: dict[int, torch.Tensor] = {}
            bind(module, {n: (p, copies.setdefault(id(t), t.detach().clone())) for n, p, t in tensors(module)})
        self.shared = {}

    def rebind(self, pipe) -> None:
        """Every component the segment holds pointed at its views again (after a plan's removal brought
        them back to the CPU as copies); one that no longer matches (quantized since) stays its own."""
        if self.segment is None:
            return
        modules = _modules(pipe)
        for name in self.segment.manifest["components"]:
            if name in modules:
                self._bind(name, modules[name])

    def _bind(self, name: str, module: torch.nn.Module) -> None:
        views = self.segment.views(name)
        if shareable(module) and _matches(module, views):
            bind(module, views)
            self.shared[name] = module
        else:
            self.shared.pop(name, None)

    def pin(self, plan) -> None:
        """On CUDA, page-lock in place the ranges of the components `plan` streams, or swaps on and off the
        device between phases (before group offloading looks for a pinned copy: it finds these and makes
        none of its own)."""
        if self.segment is None or not torch.cuda.is_available():
            return
        want = [n for n in _host_held(plan) if n in self.shared and n not in self.pinned]
        if want and self.segment.register_note is None:
            self.segment.register(want)
            self.pinned.update(n for n in want if self.segment.register_note is None)

    def to_host(self, name: str, module: torch.nn.Module) -> None:
        """A phase's component off the device: bound to the node's copy again (no copy back, nothing of
        this worker's own), or moved to the CPU where it is this worker's own."""
        if self.segment is not None and name in self.shared and _matches(module, self.segment.views(name)):
            bind(module, self.segment.views(name))
        else:
            module.to("cpu")

    def settle(self, plan, device: torch.device) -> None:
        """Once the plan is kept: where it holds every shared component on the device for good (all
        resident, not phased), this worker needs the node's copy no more, and leaves it (the node's copy
        goes with its last user). A later re-plan (a step-down) then copies back a copy of its own."""
        if self.segment is None or device.type == "cpu":
            return
        if not any(n in self.shared for n in _host_held(plan)):
            self.released = sorted(self.shared)
            self.close()

    def record(self, pipe) -> dict:
        """What the worker record says: where the copy lives, the bytes shared and its own."""
        own = sum(
            t.numel() * t.element_size()
            for n, m in _modules(pipe).items()
            if n not in self.shared
            for _, _, t in tensors(m)
            if t.device.type == "cpu" and type(t.data) is torch.Tensor
        )
        out = {"mode": self.mode, "shared": bool(self.shared), "own_bytes": own, "memory": process_memory()}
        if self.segment is not None:
            out.update(
                segment=self.segment.paths["data"].name,
                role=self.segment.role,
                shared_bytes=sum(self.segment.bytes_of(n) for n in self.shared),
                components={n: ("shared" if n in self.shared else "own") for n in _modules(pipe)},
                built=self.built,
                seconds=round(self.seconds, 3),
            )
            if torch.cuda.is_available():
                out["registered_bytes"] = sum(size for _, size in self.segment.registered)
                if self.segment.register_note:
                    out["register_note"] = self.segment.register_note
        if self.released:
            out["released"] = self.released
            out["note"] = "its plan holds every component on the device: it left the node's copy once loaded"
        if self.note:
            out["note"] = self.note
        return out

    def close(self) -> None:
        if self.segment is not None:
            self.shared = {}
            self.segment.leave()
            self.segment = None


def _hint(why: str) -> str:
    """The fix a fallback's line names: more room, a directory of one's own, or a shared directory at all."""
    if "missing" in why:
        return "set FLEETGEN_SHM_DIR to a tmpfs, or pass --host-copy worker"
    if "belongs to uid" in why or "not a directory" in why or "has mode" in why or "cannot open" in why:
        return PRIVATE_HINT
    if "waited" in why:
        return "raise FLEETGEN_HOST_COPY_WAIT, or pass --host-copy worker"
    return SHM_HINT


def _host_held(plan) -> list[str]:
    """The components `plan` keeps a host copy of while it runs: offloaded (not to disk), or resident in
    a phase (swapped on and off the device)."""
    phased = {n for phase in plan.phases or () for n in phase}
    return [n for n, p in plan.placements.items() if (p.mode != "resident" and not p.disk) or n in phased]


def _modules(pipe) -> dict[str, torch.nn.Module]:
    return {n: c for n, c in getattr(pipe, "components", {}).items() if isinstance(c, torch.nn.Module)}

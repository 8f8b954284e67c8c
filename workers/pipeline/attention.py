"""The attention kernel a fitted pipeline's denoisers run (`--attention`; fleetgen/attention.py says
which kernels keep pixels): the one named, or under `auto` the fastest exact kernel this worker
has, measured here at the job's shapes. Set through diffusers' dispatcher
(`ModelMixin.set_attention_backend`); what was chosen and why goes into `workers/<w>.json`.

An exact kernel the worker cannot run (not installed, not for this device or dtype) is replaced by
`auto`'s choice and the reason said: the pixels are the same within rounding. An inexact kernel
(SageAttention) is the job's: a worker that cannot run it fails instead.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from fleetgen.attention import AUTO, CANDIDATES, NATIVE, is_exact
from fleetgen.errors import OffloadError, one_line

REPEATS = 3  # timed calls per kernel after one untimed (its first call may build or load a kernel)
# Tokens `auto` measures at, at most: a clip's 75,600 would put GiBs of q, k and v beside the resident
# model just to rank kernels. Assumed: the ranking at 16,384 holds at more (unmeasured until a GPU run).
MEASURE_TOKENS = 16_384


@dataclass
class AttentionChoice:
    asked: str  # `--attention` as given
    backend: str  # what the denoisers run
    reason: str
    measured_ms: dict[str, float | str] = field(default_factory=dict)  # auto: per kernel, ms per call or why not

    def to_dict(self) -> dict:
        return {"asked": self.asked, "backend": self.backend, "reason": self.reason, "measured_ms": self.measured_ms}


def _routed(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The attention modules whose processors take a backend from diffusers' dispatcher."""
    return [m for m in module.modules() if hasattr(getattr(m, "processor", None), "_attention_backend")]


def dispatched(module: torch.nn.Module) -> bool:
    """Whether a denoiser's attention goes through diffusers' dispatcher (its processors take a
    backend): the transformers do; a UNet's `AttnProcessor2_0` calls torch's SDPA itself."""
    return bool(_routed(module))


def missing(backend: str) -> str | None:
    """Why this process cannot run `backend` (None: it can, as far as diffusers' own check goes)."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _check_attention_backend_requirements

    try:
        _check_attention_backend_requirements(AttentionBackendName(backend))
    except (RuntimeError, ImportError) as err:
        return str(err).split(". ")[0]
    return None


def attention_shape(module: torch.nn.Module, tokens: int) -> tuple[int, int, int, int]:
    """(batch, tokens, heads, head dim) of one attention call of the denoiser, as diffusers' dispatcher
    takes them; heads and head dim from the model's config, else from its first attention module."""
    config = getattr(module, "config", {}) or {}
    heads, dim = config.get("num_attention_heads"), config.get("attention_head_dim")
    if not (isinstance(heads, int) and isinstance(dim, int)):
        attn = _routed(module)[0]
        heads = attn.heads
        dim = attn.to_q.out_features // heads
    return 1, min(max(tokens, 16), MEASURE_TOKENS), heads, dim


def time_kernel(backend: str, shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> float:
    """Seconds per attention call of `backend` at `shape` (the median of REPEATS after a first call)."""
    from diffusers.models.attention_dispatch import AttentionBackendName, dispatch_attention_fn

    gen = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(shape, generator=gen, dtype=torch.float32).to(device, dtype) for _ in range(3))
    name = AttentionBackendName(backend)
    times = []
    for i in range(REPEATS + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        dispatch_attention_fn(q, k, v, backend=name)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure(
    shape: tuple[int, ...], device: torch.device, dtype: torch.dtype, candidates=CANDIDATES
) -> dict[str, float | str]:
    """{kernel: ms per call, or why it cannot run here} for each candidate."""
    out: dict[str, float | str] = {}
    for backend in candidates:
        if backend == "_native_math" and device.type == "cuda":
            continue  # it materialises the whole attention matrix: never the fastest on a GPU, and unplanned memory
        why = missing(backend)
        if why is None:
            try:
                out[backend] = round(time_kernel(backend, shape, device, dtype) * 1e3, 3)
                continue
            except Exception as err:  # noqa: BLE001 - a kernel that does not run here is not a candidate
                why = one_line(err)[:160]
        out[backend] = why
    return out


def choose_attention(
    asked: str, denoisers: dict[str, torch.nn.Module], device: torch.device, dtype: torch.dtype, tokens: int
) -> AttentionChoice:
    """The kernel the denoisers will run, and why. Raises `OffloadError` for an inexact kernel this
    worker cannot run (the job's pixels depend on it)."""
    routed = {n: m for n, m in denoisers.items() if dispatched(m)}
    if not routed:
        names = ", ".join(f"{n} ({type(m).__name__})" for n, m in denoisers.items()) or "no denoiser"
        if not is_exact(asked):
            raise OffloadError(f"`--attention {asked}`: {names} takes no attention backend in diffusers.")
        return AttentionChoice(asked, NATIVE, f"{names}: its attention takes no backend in diffusers (torch SDPA)")
    if asked == NATIVE:
        return AttentionChoice(asked, NATIVE, "as asked (diffusers' default, torch SDPA)")
    shape = attention_shape(next(iter(routed.values())), tokens)
    at = f"at {shape[1]} tokens x {shape[2]} heads x {shape[3]}, {str(dtype).removeprefix('torch.')}"
    if asked != AUTO:
        result = measure(shape, device, dtype, (asked,))[asked]
        if isinstance(result, float):
            return AttentionChoice(asked, asked, f"as asked ({result:g} ms per call {at})", {asked: result})
        if not is_exact(asked):
            raise OffloadError(
                f"`--attention {asked}` cannot run on this worker ({result}); it changes pixels, so the job's "
                "workers must all run it. Install it on every worker or choose an exact kernel."
            )
        fallback = choose_attention(AUTO, denoisers, device, dtype, tokens)
        reason = f"`{asked}` cannot run here ({result}); {fallback.backend} instead, {fallback.reason}"
        return AttentionChoice(asked, fallback.backend, reason, {asked: result, **fallback.measured_ms})
    measured = measure(shape, device, dtype)
    ran = {k: v for k, v in measured.items() if isinstance(v, float)}
    if not ran:
        return AttentionChoice(asked, NATIVE, f"no exact kernel ran {at}: diffusers' default", measured)
    best = min(ran, key=ran.get)
    listed = ", ".join(f"{k} {v:g} ms" for k, v in sorted(ran.items(), key=lambda kv: kv[1]))
    return AttentionChoice(asked, best, f"fastest of {len(ran)} exact kernels measured {at}: {listed}", measured)


def set_attention(denoisers: dict[str, torch.nn.Module], backend: str) -> None:
    """Route every denoiser that takes a backend to `backend` (diffusers' default needs no call): each
    of its attention processors carries it. diffusers also makes it the process's active backend,
    which every other model of the process would then run (another pipeline loaded beside it, as
    `calibrate` and the GPU check load them: a masked one fails on a kernel that takes no mask): that
    is put back at once. `reset_attention` undoes the rest."""
    if backend == NATIVE and _default() == NATIVE:  # DIFFUSERS_ATTN_BACKEND may have made another the default
        return
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    for module in denoisers.values():
        if dispatched(module):
            module.set_attention_backend(backend)
    _AttentionBackendRegistry.set_active_backend(AttentionBackendName(_default()))


def reset_attention(denoisers: dict[str, torch.nn.Module], backend: str) -> None:
    """Undo `set_attention`: the denoisers' processors and the process's active backend back to the default."""
    if backend == NATIVE and _default() == NATIVE:
        return  # set_attention did nothing
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    for module in denoisers.values():
        if dispatched(module):
            module.reset_attention_backend()
    _AttentionBackendRegistry.set_active_backend(AttentionBackendName(_default()))


def _default() -> str:
    """The process's default backend: diffusers' `native`, unless DIFFUSERS_ATTN_BACKEND names another."""
    from diffusers.models.attention_dispatch import DIFFUSERS_ATTN_BACKEND

    return DIFFUSERS_ATTN_BACKEND

"""Attention kernels (`--attention`): which ones there are, which keep pixels, and what the job's
fingerprint holds, as one record parsed once (`AttentionSpec`) — plain data, no torch, shared by the job's config (jobs/) and the worker that
measures and sets them (workers/pipeline/attention.py).

diffusers (0.42) dispatches a transformer's attention to one of its backends
(`ModelMixin.set_attention_backend`). Every backend but SageAttention computes softmax(QK^T)V
exactly, differing from torch's SDPA only in rounding, as kernels and batch sizes already do: such
a kernel keeps pixels and may differ per worker. SageAttention quantizes Q and K to int8 (and PV
to fp8 in some variants): it changes pixels, so it is job-level — in the fingerprint, the same on
every worker, and a worker that lacks it fails rather than falling back.
"""

from __future__ import annotations

from dataclasses import dataclass

from fleetgen.errors import ConfigError

NATIVE = "native"  # torch's scaled_dot_product_attention, diffusers' default: what a job gets unless asked
AUTO = "auto"  # each worker measures the exact kernels it has and keeps the fastest
EXACT_SETTING = "exact"  # the fingerprint's value for any exact kernel: the worker's own choice
# diffusers 0.42.1's AttentionBackendName values (tests/workers/pipeline/test_speed.py fails when they move).
EXACT = (
    "native",
    "_native_math",
    "_native_efficient",
    "_native_flash",
    "_native_cudnn",
    "_native_npu",
    "_native_xla",
    "flex",
    "flash",
    "flash_varlen",
    "_flash_3",
    "_flash_varlen_3",
    "flash_hub",
    "flash_varlen_hub",
    "flash_4_hub",
    "_flash_3_hub",
    "_flash_3_varlen_hub",
    "aiter_fa2_hub",
    "xformers",
)
INEXACT = (
    "sage",
    "sage_hub",
    "sage_blackwell_hub",
    "sage_varlen",
    "_sage_qk_int8_pv_fp8_cuda",
    "_sage_qk_int8_pv_fp8_cuda_sm90",
    "_sage_qk_int8_pv_fp16_cuda",
    "_sage_qk_int8_pv_fp16_triton",
)
# What `auto` measures: the exact kernels that need nothing fetched at start (a `*_hub` backend downloads
# its kernel from the Hugging Face hub when set, so it runs only when named) and that run on GPUs or CPUs
# (NPU and XLA backends need their own devices).
CANDIDATES = (
    "native",
    "_native_math",
    "_native_efficient",
    "_native_flash",
    "_native_cudnn",
    "flash",
    "_flash_3",
    "xformers",
)


@dataclass(frozen=True)
class AttentionSpec:
    """`--attention` parsed: the kernel every worker's denoisers are asked to run."""

    backend: str = NATIVE  # native | auto | one of diffusers' backends (lower case, as diffusers spells them)

    @property
    def exact(self) -> bool:
        return self.backend == AUTO or self.backend in EXACT

    @property
    def label(self) -> str:
        """What the job's fingerprint (and every image) holds: an inexact kernel by name, else `exact`
        (an exact kernel keeps pixels: each worker's own choice)."""
        return EXACT_SETTING if self.exact else self.backend


def parse_attention(value: str | AttentionSpec | None) -> AttentionSpec:
    """`auto`, or a backend name (any case, as diffusers spells it)."""
    if isinstance(value, AttentionSpec):
        return value
    text = (value or NATIVE).strip().lower()
    if text == AUTO or text in EXACT or text in INEXACT:
        return AttentionSpec(text)
    raise ConfigError(
        f"`--attention` must be auto or one of diffusers' attention backends ({', '.join(EXACT + INEXACT)}); "
        f"got `{value}`."
    )


def is_exact(backend: str) -> bool:
    return AttentionSpec(backend).exact

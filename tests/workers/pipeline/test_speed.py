"""Attention kernels and compilation on a fitted pipeline (workers/pipeline/attention.py, compiling.py)."""

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from fleetgen.attention import CANDIDATES, EXACT, INEXACT, parse_attention
from fleetgen.errors import ConfigError, OffloadError
from fleetgen.offload.stats import find_groups
from fleetgen.workers.pipeline.attention import dispatched
from fleetgen.workers.spec import GenerationSettings
from tests.conftest import pixels, run_one_shard, write_prompts

FLUX = GenerationSettings(task="text-to-image", steps=3, guidance=3.5, width=64, height=64, family="flux")


@pytest.fixture
def prompts(tmp_path):
    return write_prompts(tmp_path / "p.parquet", ["a red fox", "a blue boat"], id=["a", "b"])


def _worst(out_a, rows_a, out_b, rows_b) -> float:
    return max(np.abs(pixels(out_a, rows_a[k]) - pixels(out_b, rows_b[k])).max() for k in rows_a)


def test_the_kernel_table_is_diffusers_own_and_only_sage_is_the_jobs():
    from diffusers.models.attention_dispatch import AttentionBackendName

    assert set(EXACT) | set(INEXACT) == {b.value for b in AttentionBackendName}  # fails when diffusers adds one
    assert set(CANDIDATES) <= set(EXACT) and not any(b.endswith("_hub") for b in CANDIDATES)
    assert parse_attention(None).backend == "native" and parse_attention(" AUTO ").backend == "auto"
    assert [parse_attention(b).label for b in ("native", "auto", "flash", "_native_cudnn")] == ["exact"] * 4
    assert (
        parse_attention("sage").label == "sage"
        and parse_attention("_sage_qk_int8_pv_fp8_cuda").label == "_sage_qk_int8_pv_fp8_cuda"
    )
    with pytest.raises(ConfigError, match="`--attention` must be auto or one of .*got `flash2`"):
        parse_attention("flash2")


def test_auto_measures_the_kernels_here_and_keeps_the_fastest(tiny_flux, prompts, tmp_path):
    native, rows = run_one_shard(tiny_flux, tmp_path / "native", prompts, FLUX, max_batch=2)
    worker, auto_rows = run_one_shard(
        tiny_flux, tmp_path / "auto", prompts, FLUX, max_batch=2, attention=parse_attention("auto")
    )
    info = json.loads((tmp_path / "auto" / "workers" / "w0.json").read_text())["attention"]
    ran = {k: v for k, v in info["measured_ms"].items() if isinstance(v, float)}
    assert {"native", "_native_math"} <= set(ran)  # torch's own kernels run on any CPU
    assert info["backend"] == min(ran, key=ran.get) and info["reason"].startswith(f"fastest of {len(ran)} exact")
    assert "flash" in info["measured_ms"] and "not usable" in info["measured_ms"]["flash"]  # not installed: said
    assert {r["attention"] for r in auto_rows.values()} == {info["backend"]}
    assert {r["attention"] for r in rows.values()} == {"native"}
    assert _worst(tmp_path / "native", rows, tmp_path / "auto", auto_rows) <= 2  # exact: rounding at most


def test_an_exact_kernel_missing_here_falls_back_and_says_so(tiny_flux, prompts, tmp_path):
    worker, rows = run_one_shard(tiny_flux, tmp_path / "o", prompts, FLUX, attention=parse_attention("flash"))
    choice = worker.fitted.attention
    assert choice.asked == "flash" and choice.backend in CANDIDATES
    assert choice.reason.startswith("`flash` cannot run here (Flash Attention backend 'flash' is not usable")
    assert {r["attention"] for r in rows.values()} == {choice.backend}


def test_a_kernel_one_worker_runs_is_not_the_process_default(tiny_flux, prompts, tmp_path):
    """diffusers makes a model's backend the process's active one; fleetgen puts it back at once, so a
    pipeline loaded beside it in one process (calibrate's candidates, the GPU check's rows) runs its own:
    a masked attention (LTX-2, HunyuanVideo) must not meet a kernel that takes no mask."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry, dispatch_attention_fn

    worker, rows = run_one_shard(tiny_flux, tmp_path / "o", prompts, FLUX, attention=parse_attention("_native_flash"))
    try:
        assert worker.fitted.attention.backend == "_native_flash" and {r["attention"] for r in rows.values()} == {
            "_native_flash"
        }
        carried = {p._attention_backend for p in worker.pipe.transformer.attn_processors.values()}
        assert {getattr(b, "value", b) for b in carried} == {"_native_flash"}
        assert _AttentionBackendRegistry._active_backend.value == "native"
        q = k = v = torch.randn(1, 8, 2, 16)
        mask = torch.ones(1, 1, 8, 8, dtype=torch.bool)
        assert dispatch_attention_fn(q, k, v, attn_mask=mask).shape == q.shape  # the default kernel takes masks
    finally:
        worker.close()


def test_an_inexact_kernel_never_falls_back(tiny_flux, prompts, tmp_path):
    with pytest.raises(OffloadError, match="`--attention sage` cannot run on this worker .* changes pixels"):
        run_one_shard(tiny_flux, tmp_path / "o", prompts, FLUX, attention=parse_attention("sage"))


def test_a_unet_takes_no_kernel_choice(tiny_model, prompts, tmp_path):
    settings = GenerationSettings(family="sd", task="text-to-image", steps=2, guidance=5.0, width=64, height=64)
    worker, rows = run_one_shard(tiny_model, tmp_path / "o", prompts, settings, attention=parse_attention("auto"))
    assert not dispatched(worker.pipe.unet) and worker.fitted.attention.backend == "native"
    assert "takes no backend in diffusers" in worker.fitted.attention.reason
    with pytest.raises(OffloadError, match="`--attention sage`: unet .* takes no attention backend"):
        run_one_shard(tiny_model, tmp_path / "o2", prompts, settings, attention=parse_attention("sage"))


@pytest.mark.slow
def test_compiled_under_offloading_and_again_after_an_oom_step_down(tiny_model, prompts, tmp_path):
    """Regional compilation of the tiny SD UNet's transformer blocks while resident; an OOM (injected
    while the UNet is resident) leans the plan, and the worker takes compilation off, re-applies
    offloading, compiles again: the images match the uncompiled ones within rounding."""
    from fleetgen.jobs.sharding import plan_shards, read_footer, resolve_columns
    from fleetgen.workers.rows.shard import Columns
    from fleetgen.workers.spec import WorkerSpec
    from fleetgen.workers.worker import Worker

    settings = GenerationSettings(family="sd", task="text-to-image", steps=2, guidance=5.0, width=64, height=64)
    _, plain = run_one_shard(tiny_model, tmp_path / "plain", prompts, settings, max_batch=1)

    def fail_while_resident(module, args):
        if not find_groups(module):
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    files = [read_footer(str(prompts))]
    out = tmp_path / "compiled"
    spec = WorkerSpec.of(
        "w0", tiny_model, str(out), settings, resolve_columns(files, Columns()), max_batch=1, device="cpu"
    )
    worker = Worker(spec.with_options(compile=True, gpu_memory=1 << 30))
    assert set(worker.plan.modes.values()) == {"resident"}
    worker.pipe.unet.register_forward_pre_hook(fail_while_resident)
    try:
        result = worker.run_shard(plan_shards(files, 100)[0])
    finally:
        worker.close()
    assert result.ok == 2 and worker.plan.modes["unet"] != "resident"
    info = json.loads((out / "workers" / "w0.json").read_text())["compile"]
    assert info["modes"] == {"unet": "regional (4 blocks)"} and info["compiled"] == 1 + len(worker.step_downs) > 1
    assert info["compile_seconds"] > 0 and info["graphs"] > 0 and info["disabled"] is None
    rows = {r["id"]: r for r in pq.read_table(out / "shards").to_pylist()}
    assert _worst(tmp_path / "plain", plain, out, rows) <= 2


@pytest.mark.slow
def test_a_compiler_that_fails_is_taken_off_and_said(tiny_flux, prompts, tmp_path):
    """No working C++ compiler (what a slim image without one gives inductor on CPU): the worker
    warms up, the compile fails, it runs uncompiled and its stats say why."""
    import torch._inductor.config as inductor

    # a cached graph would need no compiler; the config's own patch puts both back (monkeypatch would
    # delete what it did not find in the module's __dict__)
    with inductor.patch({"cpp.cxx": ("/nonexistent/c++",), "fx_graph_cache": False}):
        worker, rows = run_one_shard(tiny_flux, tmp_path / "o", prompts, FLUX, compile=True)
    info = json.loads((tmp_path / "o" / "workers" / "w0.json").read_text())["compile"]
    assert "InvalidCxxCompiler" in info["disabled"] and {r["status"] for r in rows.values()} == {"ok"}
    assert not any(getattr(m, "_compiled_call_impl", None) for m in worker.pipe.transformer.modules())


@pytest.mark.slow
def test_lora_switches_recompile_per_adapter_and_scale_kind_not_per_switch(tiny_model, tmp_path):
    """Tiny SD with two LoRA adapters, 9 looks switching between none, A and B at four scales (8
    switches): dynamo makes a graph the first time an adapter or a changed scale reaches the compiled
    blocks, then treats the scale as dynamic — at most 2 graphs per adapter past the warm-up's, never
    one per switch — and each look's images are the uncompiled worker's within rounding."""
    import pyarrow as pa

    from fleetgen.jobs.sharding import plan_shards, read_footer, resolve_columns
    from fleetgen.workers.rows.shard import Columns
    from fleetgen.workers.spec import WorkerSpec
    from fleetgen.workers.tiny import write_tiny_lora
    from fleetgen.workers.worker import Worker

    a = str(write_tiny_lora(tmp_path / "a.safetensors", tiny_model, seed=1))
    b = str(write_tiny_lora(tmp_path / "b.safetensors", tiny_model, seed=2))
    looks = [(None, None), (a, None), (b, 0.5), (None, None), (a, 0.7), (b, None), (a, 0.3), (b, 0.9), (a, None)]
    n = 2 * len(looks)
    path = tmp_path / "p.parquet"
    table = {"prompt": ["a lighthouse"] * n, "id": [f"r{i:02d}" for i in range(n)]}
    table |= {"lora": [looks[i // 2][0] for i in range(n)], "lora_scale": [looks[i // 2][1] for i in range(n)]}
    pq.write_table(pa.table(table), path)
    files = [read_footer(str(path))]
    columns = resolve_columns(files, Columns.of(lora="lora", lora_scale="lora_scale"))
    settings = GenerationSettings(family="sd", task="text-to-image", steps=2, guidance=5.0, width=64, height=64)
    rows = {}
    for compiled in (False, True):
        out = tmp_path / f"o{compiled}"
        spec = WorkerSpec.of("w0", tiny_model, str(out), settings, columns, max_batch=2, device="cpu")
        worker = Worker(spec.with_options(adapters=((a, a), (b, b)), compile=compiled))
        warmed = worker.fitted.compiled.snapshot()["graphs"] if compiled else None
        assert worker.run_shard(plan_shards(files, 100)[0]).ok == n
        if compiled:
            info = worker.describe()["compile"]
            assert warmed > 0 and 0 < info["graphs"] - warmed <= 2 * 2 < len(looks) - 1, (warmed, info)
            assert info["compiled"] == 1 and info["disabled"] is None
        worker.close()
        rows[compiled] = {r["id"]: r for r in pq.read_table(out / "shards").to_pylist()}
    assert {r["batch"] for r in rows[True].values()} == {2}  # one call per look
    assert _worst(tmp_path / "oFalse", rows[False], tmp_path / "oTrue", rows[True]) <= 2

"""The benchmark scripts keep working (they are how BENCHMARKS.md is made)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import inner_pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_offload_script_runs_tiny_on_cpu(tmp_path):
    out = tmp_path / "gpu.json"
    subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_offload.py"), "--tiny", "--json", str(out)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    result = json.loads(out.read_text())
    assert set(result["modes"]) == {"resident", "block_level(1)", "leaf_level"}
    assert all(m["steps_per_s"] > 0 for m in result["modes"].values())
    assert result["modes"]["block_level(1)"]["moved_bytes_per_step"] > 0
    plans = [b["plan"]["modes"]["transformer"] for b in result["budgets"]]
    assert plans[0] == "resident" and plans[-1] != "resident"  # 80 GiB holds it; 12 GiB does not
    assert all("steps_per_s" in b["measured"] for b in result["budgets"])


@pytest.mark.gpu
def test_streams_on_cuda_give_the_same_latents():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from fleetgen.offload import OffloadPlan, Placement, apply, profile_pipeline
    from fleetgen.workers.tiny.flux import build_tiny_flux

    def run(placements):
        pipe = build_tiny_flux()
        pipe.set_progress_bar_config(disable=True)
        apply(pipe, OffloadPlan(placements, 1), profile_pipeline(pipe), torch.device("cuda"))
        return pipe(
            prompt=["a red fox"],
            num_inference_steps=3,
            width=32,
            height=32,
            max_sequence_length=32,
            generator=[torch.Generator().manual_seed(1)],
            output_type="np",
        ).images

    ref = run({})
    streamed = run(
        {"transformer": Placement("block", 1, stream=True), "text_encoder_2": Placement("leaf", stream=True)}
    )
    assert (abs(ref - streamed)).max() == 0


@pytest.mark.slow
def test_gpu_check_dry_run_takes_every_path_on_cpu(tmp_path):
    """`make gpu-check-dry`: the GPU check's own code at tiny size on CPU (its gpu tests skip), so
    the script a GPU session runs once cannot rot."""
    out = tmp_path / "gpu-check.json"
    proc = subprocess.run(
        # compile's row is the same measure() with compile=True (tests/workers/pipeline/test_speed.py compiles on CPU);
        # left out here, where inductor would take a minute
        [
            sys.executable,
            str(ROOT / "bench" / "gpu_check.py"),
            "--dry",
            "--speed",
            "cache,attention",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["gpu_tests"]["returncode"] == 5 or "skipped" in result["gpu_tests"]["summary"]
    assert [r["model"] for r in result["rows"]][0] == "flux.1-dev"  # the headline model first
    for model in ("sdxl", "flux.1-dev"):
        rows = {r["run"]: r for r in result["rows"] if r["model"] == model}
        assert not any("error" in r for r in rows.values()), rows
        assert rows["all resident"]["images"] == 2 and rows["all resident"]["batch"] >= 2
        measured = [r for r in rows.values() if "images" in r and r["run"].endswith("(scaled)")]
        assert len(measured) >= 4 and all(r["images"] == 2 and r["images_per_second"] > 0 for r in measured)
        assert all(r["seconds_per_image"]["measured"] > 0 for r in measured)
        assert any(set(r["modes"].values()) != {"resident"} for r in measured)  # an offloaded row is measured
        # the plan sweep: a worker with trials on timed the model's best plans on the device, then made its shard
        (sweep,) = [r for r in rows.values() if r["run"].startswith("trials ")]
        assert sweep["images"] == 2 and sweep["chosen_by"] in ("measured", "model") and sweep["trials"], sweep
        assert all(t["measured_seconds_per_image"] or t.get("error") for t in sweep["trials"])
        oom = rows["forced OOM"]
        assert oom["ok"] and oom["images"] == 8 and oom["hooks_after_close"] == 0
        assert set(oom["final_modes"].values()) != {"resident"}
    # the phased rows: FLUX.1 per batch, then phased, at its (scaled) 16 GiB budget
    phased = {
        r["run"].split(" ")[0]: r
        for r in result["rows"]
        if r["model"] == "flux.1-dev" and "phases" in r and not r["run"].startswith("trials ")
    }
    assert set(phased) == {"per", "phased"} and not any("error" in r for r in phased.values()), phased
    assert phased["per"]["phased"] is None and phased["phased"]["phased"]["chunks"] >= 1
    assert phased["phased"]["images"] == 2
    # SDXL in float16 with the OOM raised in its upcast VAE decode: the VAE is float16 again after
    sdxl_oom = next(r for r in result["rows"] if r["model"] == "sdxl" and r["run"] == "forced OOM")
    assert sdxl_oom["vae_dtype"] == "float16"
    # the speed rows: FLUX.1 takes a first-block cache (counted) and measures its attention kernels;
    # SDXL's UNet says why no cache
    cached = [r for r in result["rows"] if r["model"] == "flux.1-dev" and r.get("cache", "none") != "none"]
    assert cached and all(r["batch"] == 1 and r["cache_counts"]["block_evaluations"] > 0 for r in cached), cached
    assert any("vs_plain" in r for r in cached)
    kernels = [r for r in result["rows"] if r["model"] == "flux.1-dev" and r.get("attention") == "auto"]
    assert kernels and all(isinstance(r["attention_kernel"]["measured_ms"]["native"], float) for r in kernels)
    sdxl_cache = next(r for r in result["rows"] if r["model"] == "sdxl" and r["run"].startswith("cache"))
    assert "takes no step cache" in sdxl_cache["skipped"]
    assert "forced OOM" in proc.stdout and "s/image" in proc.stdout


@pytest.mark.slow
def test_gpu_check_writes_every_row_as_it_goes_and_skips_past_its_time_limit(tmp_path):
    """On a lent GPU only `$OUT` comes back: the JSON is there from the start and after each row;
    past `--time-limit`, rows are recorded as skipped instead of running past the session."""
    out = tmp_path / "OUT"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "gpu_check.py"),
            "--dry",
            "--skip-tests",
            "--time-limit",
            "0",
            "--models",
            "sdxl",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OUT": str(out)},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((out / "gpu-check.json").read_text())
    assert result["rows"] == [{"model": "sdxl", "run": "all", "skipped": "--time-limit 0 s reached"}]
    assert result["meminfo"]["MemTotal"] > 0 and "seconds" in result


def test_the_suite_timeline_records_each_test_once_per_worker_and_sums_them(tmp_path):
    """bench/suite_timeline.py as BENCHMARKS.md runs it: a pytest run of two workers writes one line per
    test from the worker that ran it, and the summary counts them."""
    (tmp_path / "test_inner.py").write_text(
        "import time, pytest\n\n@pytest.mark.parametrize('i', range(6))\ndef test_sleep(i):\n    time.sleep(0.1)\n"
    )
    timeline = tmp_path / "timeline.jsonl"
    inner_pytest(tmp_path, "-p", "bench.suite_timeline", FLEETGEN_TIMELINE=str(timeline))
    rows = [json.loads(line) for line in timeline.read_text().splitlines()]
    ran = [r for r in rows if r["w"] != "main"]
    assert sorted(r["id"] for r in ran) == sorted(f"test_inner.py::test_sleep[{i}]" for i in range(6))
    assert all(r["t1"] - r["t0"] >= 0.1 and r["busy"] >= 0 and r["idle"] >= 0 for r in ran)
    from bench.suite_timeline import summary

    text = summary(rows)
    assert text.startswith("6 tests in ") and "(no group) " in text and "idle CPU while gw" in text

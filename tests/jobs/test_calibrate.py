"""`fleetgen calibrate`: the quality measures against scikit-image's, a run on the tiny FLUX.1 whose
choice keeps the floor it was given, and a snippet `fleetgen run --config` takes."""

import math
import subprocess
import sys

import numpy as np
import pytest

from fleetgen.errors import ConfigError
from fleetgen.jobs.calibrate import REFERENCE, Calibration, Result, calibrate, psnr, ssim
from fleetgen.jobs.config import make_config
from fleetgen.jobs.models import resolve_defaults
from fleetgen.jobs.sharding import read_footer, resolve_columns
from fleetgen.workers.rows.shard import Columns
from tests.conftest import FAST, ROOT, run_args, write_prompts

FLUX = {**FAST, "steps": 8}  # enough steps for the caches to predict some


def test_psnr_and_ssim_are_scikit_images():
    from skimage.metrics import peak_signal_noise_ratio, structural_similarity

    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, (48, 40, 3), dtype=np.uint8)
    smooth = np.clip(np.cumsum(rng.normal(0, 4, (48, 40, 3)), axis=0) + 128, 0, 255).astype(np.uint8)
    for x, y in ((a, smooth), (smooth, np.clip(smooth.astype(int) + rng.integers(-9, 10, smooth.shape), 0, 255))):
        y = y.astype(np.uint8)
        assert ssim(x, y) == pytest.approx(structural_similarity(x, y, channel_axis=-1, data_range=255), abs=1e-9)
        assert psnr(x, y) == pytest.approx(peak_signal_noise_ratio(x, y, data_range=255), abs=1e-9)
    assert psnr(a, a) == math.inf and ssim(a, a) == pytest.approx(1.0)


def test_the_choice_is_the_fastest_within_the_floor_that_beats_the_noise():
    def r(name, speed, p, **settings):
        return Result(name, settings, images_per_second=speed, psnr=p, ssim=1.0, speedup=speed)

    results = [r("reference", 1.0, math.inf), r("a", 3.0, 25.0), r("b", 2.0, 40.0), r("c", 1.04, 60.0)]
    assert Calibration("m", 4, "cpu", 30.0, None, results, noise=0.05).choose().name == "b"  # a is under the floor
    assert Calibration("m", 4, "cpu", 50.0, None, results, noise=0.05).choose().name == "reference"  # c: noise


def test_a_score_floor_counts_beside_psnr():
    def r(name, speed, drop):
        return Result(
            name, dict(REFERENCE), images_per_second=speed, psnr=60.0, ssim=1.0, speedup=speed, drops={"clip": drop}
        )

    results = [r("reference", 1.0, 0.0), r("a", 3.0, 0.05), r("b", 2.0, 0.005)]
    assert Calibration("m", 4, "cpu", 30.0, None, results).choose().name == "a"  # no score floor
    floored = Calibration("m", 4, "cpu", 30.0, None, results, max_drop={"clip": 0.01})
    assert floored.choose().name == "b" and "clip at most 0.01 below the reference" in floored.snippet()


@pytest.mark.slow
def test_a_run_scores_every_candidate_against_the_reference(tiny_flux, tiny_clip, tmp_path):
    prompts = write_prompts(tmp_path / "p.parquet", [f"a photo of thing {i}" for i in range(2)])
    args = {"input": str(prompts), "model": tiny_flux, "output": str(tmp_path / "unused"), **FLUX}
    config = make_config({**args, "score": f"clip={tiny_clip}", "keep": "clip > 0.9"})
    cal = calibrate(config, sample=2, min_psnr=0.0, kinds=("cache",), say=lambda _: None, max_drop={"clip": -1.0})
    ref = cal.results[0]
    assert set(ref.scores) == {"clip"} and -1 <= ref.scores["clip"] <= 1  # every image made (no keep rule here)
    for r in cal.results[1:]:
        assert r.drops["clip"] == pytest.approx(ref.scores["clip"] - r.scores["clip"])
    assert cal.chosen is ref  # no candidate's CLIP score rises by 1: none passes the floor
    with pytest.raises(ConfigError, match="`--max-drop pickscore=...` names a score the job does not compute"):
        calibrate(config, sample=1, kinds=("cache",), max_drop={"pickscore": 0.1})


def test_a_run_keeps_the_floor_it_was_given(tiny_flux, tmp_path):
    prompts = write_prompts(tmp_path / "p.parquet", [f"a photo of thing {i}" for i in range(3)])
    args = {"input": str(prompts), "model": tiny_flux, "output": str(tmp_path / "unused"), **FLUX}
    lines = []
    cal = calibrate(make_config(args), sample=2, min_psnr=45.0, kinds=("cache",), say=lines.append)
    names = [r.name for r in cal.results]
    assert names[:2] == ["reference (exact)", "cache=first-block:0.05"] and "reference (again)" in names
    assert all(r.psnr is not None and not r.failed for r in cal.results)
    predicted = next(r for r in cal.results if r.name == "cache=taylorseer")
    assert predicted.psnr < math.inf  # it changes pixels: measured, not assumed
    assert cal.chosen.passes(45.0, None) and cal.chosen.psnr >= 45.0
    better = [r for r in cal.results if r.passes(45.0, None) and r.speedup > 1 + cal.noise]
    assert cal.chosen is max(better, key=lambda r: r.images_per_second, default=cal.results[0])
    assert lines[0].startswith("calibrating ") and not (tmp_path / "unused").exists()  # nothing written there


@pytest.mark.slow
def test_the_cli_prints_the_table_and_a_snippet_run_takes(tiny_flux, tmp_path):
    prompts = write_prompts(tmp_path / "p.parquet", [f"a photo of thing {i}" for i in range(2)])
    snippet = tmp_path / "fast.toml"
    args = run_args(prompts, tmp_path / "o", tiny_flux, steps=8)
    done = subprocess.run(
        [sys.executable, "-m", "fleetgen", "calibrate", *args, "--sample", "2", "--min-psnr", "35"]
        + ["--try", "attention,cache,quantize", "--write", str(snippet)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    table = done.stdout.split("\n\n")[0].splitlines()
    assert table[0].split()[:4] == ["setting", "img/s", "x", "ref"]
    for name in ("reference (exact)", "attention=auto", "cache=taylorseer", "quantize=transformer=fp8"):
        assert any(line.startswith(name) for line in table), name
    text = snippet.read_text()
    assert text in done.stdout and "PSNR >= 35 dB" in text
    config = make_config({"input": str(prompts), "output": str(tmp_path / "job"), "model": tiny_flux}, str(snippet))
    files = [read_footer(str(prompts))]
    resolve_defaults(config, resolve_columns(files, Columns()))  # what `fleetgen run` checks before any worker
    measured = text.splitlines()[1]  # "# 2.11x the reference's images/s, PSNR 46.1 dB"
    assert float(measured.split("PSNR ")[1].split()[0]) >= 35

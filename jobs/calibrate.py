"""`fleetgen calibrate`: the job's own first rows, made on this machine under each candidate
setting and against the exact reference of the same seeds — speed and quality side by side, then
the fastest setting within the user's quality floor, as a config snippet `fleetgen run --config`
takes.

Each candidate is a worker of its own in this process (no Ray), made as the job's workers make
them (the same seeds, per-row settings, inputs), on the job's device. Speed is the images per
second of its pipeline calls (warm-up and compilation apart: compile seconds have their own
column); quality is the PSNR and SSIM of its pixels against the reference's (lossless PNG, whatever
the job stores). Settings that keep pixels (compile, an exact attention kernel) measure only speed
(their PSNR is rounding); settings that change pixels (step caches, quantization) are what the
floor is for.
"""

from __future__ import annotations

import math
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fleetgen.caches import FIRST_BLOCK_THRESHOLD
from fleetgen.errors import ConfigError, FleetgenError
from fleetgen.jobs.config import JobConfig, resolve_paths, validate
from fleetgen.jobs.driver import read_input, worker_spec
from fleetgen.jobs.models import MAX_ADAPTERS, resolve_adapters, resolve_defaults
from fleetgen.jobs.sharding import distinct_strings, plan_shards
from fleetgen.scores import KeepRule

KINDS = ("attention", "compile", "cache", "quantize")  # what `--try` may name
FIRST_BLOCK_THRESHOLDS = (FIRST_BLOCK_THRESHOLD, 0.1, 0.2)  # diffusers' default and two that skip more
SNIPPET_KEYS = ("quantize", "cache", "attention", "compile")  # what the snippet sets: every candidate's settings
SSIM_WINDOW = 7  # scikit-image's default: a 7x7 uniform window, sample covariances (Wang et al. 2004, K1 0.01, K2 0.03)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """Peak signal-to-noise ratio of two 8-bit images, dB (inf when identical)."""
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def _box(x: np.ndarray, n: int) -> np.ndarray:
    """Means over every n x n window that fits ('valid'), by summed-area tables."""
    s = np.pad(x.cumsum(0).cumsum(1), ((1, 0), (1, 0)))
    return (s[n:, n:] - s[:-n, n:] - s[n:, :-n] + s[:-n, :-n]) / (n * n)


def ssim(a: np.ndarray, b: np.ndarray) -> float:
    """Mean structural similarity of two 8-bit images (H x W x C), averaged over channels — as
    scikit-image's `structural_similarity(a, b, channel_axis=-1, data_range=255)` computes it."""
    n, c1, c2 = SSIM_WINDOW, (0.01 * 255) ** 2, (0.03 * 255) ** 2
    cov = n * n / (n * n - 1)  # sample, not population, (co)variances
    values = []  # per channel: the mean over windows wholly inside the image (scikit-image crops the rest)
    for ch in range(a.shape[-1]):
        x, y = a[..., ch].astype(np.float64), b[..., ch].astype(np.float64)
        mx, my = _box(x, n), _box(y, n)
        vx = cov * (_box(x * x, n) - mx * mx)
        vy = cov * (_box(y * y, n) - my * my)
        vxy = cov * (_box(x * y, n) - mx * my)
        s = ((2 * mx * my + c1) * (2 * vxy + c2)) / ((mx * mx + my * my + c1) * (vx + vy + c2))
        values.append(s.mean())
    return float(np.mean(values))


@dataclass
class Result:
    """One candidate as measured: its settings over the job's, its speed and its quality."""

    name: str
    settings: dict  # over the job's (SNIPPET_KEYS)
    images_per_second: float = 0.0
    psnr: float | None = None  # mean over the sample, dB, against the reference
    ssim: float | None = None
    peak_bytes: int | None = None  # device memory at its peak (CUDA), else None
    compile_seconds: float | None = None
    device: str = ""  # the worker's device, by name
    note: str = ""  # what the worker chose (the attention kernel under auto), or why it did not run
    failed: bool = False
    speedup: float | None = None  # images/s over the reference's
    scores: dict = field(default_factory=dict)  # the job's scorers (`--score`): each one's mean over the sample
    drops: dict = field(default_factory=dict)  # each one's mean below the reference's

    def passes(self, min_psnr: float, min_ssim: float | None, max_drop: dict | None = None) -> bool:
        return (
            not self.failed
            and self.psnr is not None
            and self.psnr >= min_psnr
            and (min_ssim is None or (self.ssim or 0) >= min_ssim)
            and all(self.drops.get(n, math.inf) <= d for n, d in (max_drop or {}).items())
        )


@dataclass
class Calibration:
    model: str
    images: int
    device: str
    min_psnr: float
    min_ssim: float | None
    results: list[Result] = field(default_factory=list)
    noise: float = 0.0  # |1 - images/s of the reference measured again over its first|: gains within it are noise
    chosen: Result | None = None
    max_drop: dict = field(
        default_factory=dict
    )  # a third floor: {scorer: how far its mean may fall below the reference's}

    def choose(self) -> Result:
        """The fastest result within the floor that beats the reference by more than the noise (else the reference)."""
        ref = self.results[0]
        faster = [
            r
            for r in self.results
            if r.passes(self.min_psnr, self.min_ssim, self.max_drop) and r.speedup > 1 + self.noise
        ]
        self.chosen = max(faster, key=lambda r: r.images_per_second, default=ref)
        return self.chosen

    def table(self) -> str:
        w = max(len(r.name) for r in self.results)
        names = list(self.results[0].scores)
        head = (
            f"{'setting':<{w}} {'img/s':>8} {'x ref':>6} {'PSNR dB':>8} {'SSIM':>6} "
            + "".join(f"{n:>10} " for n in names)
            + f"{'peak':>9} {'compile s':>9}  note"
        )
        lines = [head]
        for r in self.results:
            peak = f"{r.peak_bytes / 2**30:.2f}GiB" if r.peak_bytes else "-"
            scores = "".join(f"{_num(r.scores.get(n), '.4g'):>10} " for n in names)
            lines.append(
                f"{r.name:<{w}} {r.images_per_second:>8.3f} {_num(r.speedup, '.2f'):>6} {_num(r.psnr, '.1f'):>8} "
                f"{_num(r.ssim, '.3f'):>6} {scores}{peak:>9} {_num(r.compile_seconds, '.1f'):>9}  "
                f"{'FAILED: ' if r.failed else ''}{r.note}"
            )
        lines.append(
            f"(the reference measured again ran at {1 - self.noise:.2f}-{1 + self.noise:.2f}x its first images/s: "
            "a setting must beat it by more to be chosen)"
        )
        return "\n".join(lines)

    def snippet(self) -> str:
        """The chosen settings as TOML for `fleetgen run --config` (the job's own options beside it)."""
        floor = f"PSNR >= {self.min_psnr:g} dB" + (f", SSIM >= {self.min_ssim:g}" if self.min_ssim else "")
        floor += "".join(f", {n} at most {d:g} below the reference" for n, d in self.max_drop.items())
        lines = [
            f"# fleetgen calibrate: {self.chosen.name} on {self.device}, {self.images} images of the job, {floor}",
            f"# {self.chosen.speedup:.2f}x the reference's images/s, PSNR {_num(self.chosen.psnr, '.1f')} dB",
        ]
        for key in SNIPPET_KEYS:
            value = self.chosen.settings[key]
            lines.append(
                f"{key} = {str(value).lower() if isinstance(value, bool) else repr(value).replace(chr(39), chr(34))}"
            )
        return "\n".join(lines) + "\n"


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else ("inf" if value == math.inf else format(value, fmt))


def candidates(config: JobConfig, denoisers: list[str], kinds=KINDS) -> list[tuple[str, dict]]:
    """(name, settings over the reference's) to measure, one setting at a time."""
    out = []
    if "attention" in kinds:
        out.append(("attention=auto", {"attention": "auto"}))
    if "compile" in kinds:
        out.append(("compile", {"compile": True}))
    if "cache" in kinds:
        out += [(f"cache=first-block:{t:g}", {"cache": f"first-block:{t:g}"}) for t in FIRST_BLOCK_THRESHOLDS]
        out += [("cache=taylorseer", {"cache": "taylorseer"}), ("cache=magcache", {"cache": "magcache"})]
    if "quantize" in kinds:
        import torch

        from fleetgen.offload.weight_formats import runnable, spec

        cuda = config.source.device.startswith("cuda") or (config.source.device == "auto" and torch.cuda.is_available())
        for name in runnable(cuda, at_load=True):
            for component in denoisers:
                if component in spec(name).components:
                    out.append((f"quantize={component}={name}", {"quantize": f"{component}={name}"}))
    return out


REFERENCE = {"quantize": "none", "cache": "none", "attention": "native", "compile": False}


def calibrate(
    config: JobConfig,
    sample: int = 4,
    min_psnr: float = 30.0,
    min_ssim: float | None = None,
    kinds=KINDS,
    say=print,
    max_drop: dict[str, float] | None = None,
) -> Calibration:
    """Measure each candidate on the job's first `sample` rows; `say` reports progress. `max_drop`: a
    floor on the job's scores (`--score`): {scorer: how far its mean may fall below the reference's}."""
    if sample < 1:
        raise ConfigError(f"`--sample` must be 1 or more, got `{sample}`.")
    max_drop = dict(max_drop or {})
    unscored = [n for n in max_drop if n not in config.generation.score.names]
    if unscored:
        raise ConfigError(
            f"`--max-drop {unscored[0]}=...` names a score the job does not compute; it scores: "
            f"{', '.join(config.generation.score.names) or 'none (add --score)'}."
        )
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise ConfigError(f"`--try` takes {', '.join(KINDS)}; got `{', '.join(sorted(unknown))}`.")
    # every candidate stores what it makes (no keep rule, no best-of: the pixels are compared one for one)
    config = config.with_options(keep=KeepRule(), best_of=1, rank_by=None)
    config = resolve_paths(config.with_options(**REFERENCE, output_format="files", image_format="png"))
    files, columns = read_input(config)
    config, family, _ = resolve_defaults(config, columns)
    if config.generation.task_spec().video:
        raise ConfigError("`fleetgen calibrate` compares images; video tasks are not calibrated yet.")
    shard = plan_shards(files, sample)[0]  # the job's first rows: its own prompts, seeds and settings
    say(f"calibrating {config.source.model} ({family.name}) on {shard.length} rows of {config.input}")
    adapters = resolve_adapters(config, columns, distinct_strings(files, columns["lora"], MAX_ADAPTERS))
    with tempfile.TemporaryDirectory(prefix="fleetgen-calibrate-") as work:
        return _calibrate(
            _Sample(config, columns, shard, adapters, Path(work)), min_psnr, min_ssim, kinds, say, max_drop
        )


@dataclass(frozen=True)
class _Sample:
    """What every candidate makes: the job's first rows, with the job's columns and adapters."""

    config: JobConfig  # the reference's settings
    columns: object
    shard: object
    adapters: tuple
    work: Path  # each candidate writes its output below


def _calibrate(sample: _Sample, min_psnr, min_ssim, kinds, say, max_drop: dict) -> Calibration:
    config, columns, shard, work = sample.config, sample.columns, sample.shard, sample.work
    done: list[Result] = []

    def measure(name: str, settings: dict) -> tuple[Result, dict, object]:
        result = Result(name, {**REFERENCE, **settings})
        started = time.perf_counter()
        try:
            cfg = validate(config.with_options(**settings, output=str(work / f"c{len(done)}")))
            cfg, _, _ = resolve_defaults(cfg, columns)  # the family's refusals (a cache it cannot take)
            return _run(cfg, columns, shard, sample.adapters, result)
        except (FleetgenError, RuntimeError, TypeError, ValueError) as err:
            result.failed, result.note = True, str(err).splitlines()[0][:200]
            return result, {}, None
        finally:
            say(f"  {name}: {time.perf_counter() - started:.1f} s")

    ref, ref_images, ref_worker = measure("reference (exact)", {})
    if ref.failed:
        raise FleetgenError(f"the reference run failed: {ref.note}")
    ref.psnr, ref.ssim, ref.speedup = math.inf, 1.0, 1.0
    done.append(ref)
    denoisers = [n for n, c in ref_worker.profile.components.items() if c.per_step]
    for name, settings in candidates(config, denoisers, kinds):
        result, images, _ = measure(name, settings)
        _compare(result, images, ref, ref_images)
        done.append(result)
    again, images, _ = measure("reference (again)", {})  # how far the same setting's speed moves here: the noise
    _compare(again, images, ref, ref_images)
    done.append(again)
    noise = abs(1 - again.images_per_second / ref.images_per_second) if not again.failed else 0.0
    cal = Calibration(config.source.model, shard.length, ref.device, min_psnr, min_ssim, done, noise, max_drop=max_drop)
    combined = _combined(
        [
            r
            for r in done
            if r.settings != REFERENCE and r.passes(min_psnr, min_ssim, max_drop) and r.speedup > 1 + noise
        ]
    )
    if combined is not None:
        result, images, _ = measure("combined: " + ", ".join(combined[0]), combined[1])
        _compare(result, images, ref, ref_images)
        done.append(result)
    cal.choose()
    return cal


def _combined(fast: list[Result]) -> tuple[list[str], dict] | None:
    """The fastest passing candidate of each setting together, when there are two or more."""
    best: dict[str, Result] = {}
    for r in fast:
        key = next(k for k in SNIPPET_KEYS if r.settings[k] != REFERENCE[k])
        if key not in best or r.images_per_second > best[key].images_per_second:
            best[key] = r
    if len(best) < 2:
        return None
    return [r.name for r in best.values()], {k: r.settings[k] for k, r in best.items()}


def _compare(result: Result, images: dict, ref: Result, ref_images: dict) -> None:
    if result.failed:
        return
    pairs = [(images[k], ref_images[k]) for k in ref_images if k in images]
    if len(pairs) < len(ref_images):
        result.failed, result.note = True, f"made {len(pairs)} of {len(ref_images)} images"
        return
    result.psnr = float(np.mean([psnr(a, b) for a, b in pairs]))
    result.ssim = float(np.mean([ssim(a, b) for a, b in pairs]))
    result.drops = {n: ref.scores[n] - v for n, v in result.scores.items() if n in ref.scores}
    result.speedup = result.images_per_second / ref.images_per_second if ref.images_per_second else None


def _run(config: JobConfig, columns, shard, adapters, result: Result) -> tuple[Result, dict, object]:
    """One candidate's worker over the shard: its images ({id: pixels}) and measures in `result`."""
    import pyarrow.parquet as pq
    import torch
    from PIL import Image

    from fleetgen.workers.worker import Worker

    worker = Worker(worker_spec(config, "calibrate", columns, threads=config.cpu_threads, adapters=adapters))
    try:
        cuda = worker.fitted.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(worker.fitted.device)
        outcome = worker.run_shard(shard)
        info = worker.describe()
    finally:
        worker.close()
    seconds = info["stats"]["generate_seconds"]
    result.images_per_second = outcome.ok / seconds if seconds else 0.0
    result.peak_bytes = torch.cuda.max_memory_allocated(worker.fitted.device) if cuda else None
    result.compile_seconds = (info["compile"] or {}).get("compile_seconds")
    attention = info["attention"]
    result.device = info["device"]["name"]
    skipped, notes = (info["cache"] or {}).get("skipped_share"), []
    if attention["asked"] == "auto":
        notes.append(f"attention {attention['backend']}")
    if skipped is not None:
        notes.append(f"skipped {skipped:.0%} of block evaluations")
    result.note = "; ".join(notes)
    if info["compile"] and info["compile"]["disabled"]:
        result.note = f"compile taken off: {info['compile']['disabled'][:120]}"
    out = Path(config.output)
    rows = pq.read_table(out / "shards").to_pylist()
    if outcome.errors:
        first = next(r["error"] for r in rows if r["status"] == "error")
        result.failed, result.note = True, f"{outcome.errors} error rows: {first[:160]}"
    images = {r["id"]: np.asarray(Image.open(out / r["image"]).convert("RGB")) for r in rows if r["status"] == "ok"}
    for name in config.generation.score.names:  # each scorer's mean over the sample (`--max-drop`)
        values = [r[f"score_{name}"] for r in rows if r["status"] == "ok" and r[f"score_{name}"] is not None]
        if values:
            result.scores[name] = float(np.mean(values))
    return result, images, worker

"""One device's work: load the pipeline once, then generate shards. No Ray here: `cluster/` wraps
this plain class in an actor, and a benchmark or a test can use it directly."""

from __future__ import annotations

import gc
import hashlib
import io
import json
import os
import platform
import socket
import time
import uuid
from collections import Counter, deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from fleetgen import __version__
from fleetgen.errors import FleetgenError, OffloadError, ShardError, StorageError, one_line
from offload import OffloadStats, apply, pipeline_modules, profile_pipeline
from offload.apply import unapply
from workers.batches import Adapter, Image, Look, Recipe, group_images, shard_images
from workers.commit import ATTEMPT_KEY, COUNTS_KEY, commit_manifest, counts_of, discard, promote, staging
from workers.families import FAMILIES, GENERIC, call_kwargs, prompt_limit, takes_negative_prompt
from workers.fit import choose_plan, components_dtypes_kept, is_out_of_memory, leaner_plan
from workers.layout import MANIFEST_SCHEMA, manifest_key, worker_key
from workers.pipeline import (
    activate_adapters,
    describe_device,
    load_adapters,
    load_pipeline,
    pipe_size_multiple,
    resolve_device,
    resolve_dtype,
)
from workers.probe import probe
from workers.seeds import generators
from workers.shard import Columns, Shard, read_shard
from workers.sinks import open_sink
from workers.storage import Output, read_parquet

WRITE_AHEAD = 2  # batches handed to the writer thread before the pipeline waits: one being written, one queued
_ENCODE_ARGS = {"png": {"format": "PNG"}, "jpeg": {"format": "JPEG", "quality": 95}, "webp": {"format": "WEBP", "quality": 95}}


@dataclass(frozen=True)
class GenerationSettings:
    """What every image of a job shares. Part of the job fingerprint."""

    steps: int = 30  # denoising steps per image
    guidance: float = 7.5  # classifier-free guidance scale
    width: int = 512  # pixels; must suit the model (a multiple of its VAE scale factor)
    height: int = 512
    seed: int = 0  # job seed: rows without a `seed` column derive theirs from it
    image_format: str = "png"  # png | jpeg | webp
    output_format: str = "files"  # files | webdataset | parquet
    family: str = "sd"  # pipeline family (workers/families.py): how the pipeline is called
    true_cfg_scale: float | None = None  # Flux: > 1 applies negative prompts (true CFG)
    images_per_prompt: int = 1  # images per row (a row's `num_images` column overrides it)
    prompt_template: str | None = None  # builds each prompt from columns, e.g. "a {style} photo of a {label}"
    loras: tuple[Adapter, ...] = ()  # adapters on every image (a row's `lora` column replaces them)

    def recipe(self, size_multiple: int = 8) -> Recipe:
        return Recipe(Look(self.width, self.height, self.steps, self.guidance, self.loras), seed=self.seed,
                      images_per_prompt=self.images_per_prompt, template=self.prompt_template,
                      size_multiple=size_multiple, dotless_ids=self.output_format == "webdataset")


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to start; picklable, so Ray can ship it to an actor."""

    name: str  # worker name in stats and manifests, e.g. "w0"
    model: str  # local directory or hub id, loaded with DiffusionPipeline.from_pretrained
    output: str  # the job's output URL
    settings: GenerationSettings
    columns: Columns
    max_batch: int = 4  # images per pipeline call
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (float16 on CUDA, float32 on CPU) | float32 | float16 | bfloat16
    threads: int | None = None  # torch CPU threads; None leaves torch's default
    offload: str = "auto"  # auto | none | block | leaf | disk (see offload.planner)
    gpu_memory: int | None = None  # device budget in bytes; default: free device memory (CPU: no planning)
    host_memory: int | None = None  # host RAM for offloaded copies; default: 80% of available
    trust_remote_code: bool = False  # never run a model repo's own code unless asked
    strict_prompts: bool = False  # a prompt longer than the text encoder takes is an error, not truncated
    revision: str | None = None  # hub models: the commit the driver pinned
    variant: str | None = None  # weights variant, e.g. fp16
    adapters: tuple[tuple[str, str], ...] = ()  # every LoRA the job uses (flags, `lora` column): (as named, location)
    plan_size: tuple[int, int] | None = None  # the largest (width, height) in the job, planned for


@dataclass(frozen=True)
class BatchDone:
    """Progress: one pipeline call finished."""

    shard_id: str
    worker: str
    images: int
    errors: int
    rows: float = 0.0  # input rows this call finished: each image is 1/N of a row that makes N


@dataclass(frozen=True)
class ShardResult:
    shard_id: str
    worker: str
    ok: int
    errors: int
    seconds: float  # wall time of the whole shard, reading to commit
    committed_by_other: bool = False  # another attempt of this shard committed first; this one wrote nothing more
    counts: dict | None = None  # the committed manifest's counts (its footer's), so the driver need not read it
    version: str | None = None  # the committed manifest's version, as a listing of shards/ would show it


def encode(image, image_format: str) -> bytes:
    buf = io.BytesIO()
    image.save(buf, **_ENCODE_ARGS[image_format])
    return buf.getvalue()


class Worker:
    def __init__(self, spec: WorkerSpec, pipe=None):
        """`pipe`: a pipeline already built (bench/gpu_check.py's random weights at real sizes)
        instead of loading `spec.model`; `close()` leaves it as it came (no offloading hooks)."""
        started = time.perf_counter()
        self.spec = spec
        if spec.threads:
            torch.set_num_threads(spec.threads)
        self.family = FAMILIES.get(spec.settings.family, GENERIC)
        self.device = resolve_device(spec.device)
        self.dtype = resolve_dtype(spec.dtype, self.device, self.family.dtype)
        self.output = Output(spec.output)
        self._given = pipe is not None
        self.pipe = pipe if pipe is not None else load_pipeline(
            spec.model, self.dtype, spec.trust_remote_code, revision=spec.revision, variant=spec.variant,
            worker=spec.name)
        self.pipe.set_progress_bar_config(disable=True)
        self._takes_negative = takes_negative_prompt(self.pipe)
        # Adapters before profiling and offloading: their bytes are planned for and offloaded with their layers.
        self.adapters = load_adapters(self.pipe, spec.adapters, spec.name)
        self._active: tuple[Adapter, ...] | None = None
        self.recipe = spec.settings.recipe(pipe_size_multiple(self.pipe, self.family.size_floor))
        self.profile = profile_pipeline(self.pipe, spec.model, vae_upcast=self.family.upcasts_vae)
        self.probe = probe(self.device, self.dtype)
        s = spec.settings
        width, height = spec.plan_size or (s.width, s.height)
        self._fit = {"offload": spec.offload, "width": width, "height": height, "steps": s.steps,
                     "cfg": self.family.doubles_batch(s.guidance, s.true_cfg_scale), "host_memory": spec.host_memory}
        self.plan = choose_plan(self.profile, self.device, self.probe, max_batch=spec.max_batch,
                                gpu_memory=spec.gpu_memory, **self._fit)
        self.placed = None
        self.step_downs: list[dict] = []
        try:
            self.placed = apply(self.pipe, self.plan, self.profile, self.device, tag=spec.name)
            self.offload_stats = OffloadStats(pipeline_modules(self.pipe), self.device)
            if self.device.type == "cuda":  # kernels, allocator and stream prefetch order settle on a first call
                self._warm_up(Look(width, height, 1, s.guidance))
        except BaseException:
            # A worker that cannot start leaves a pipeline it was given as it came (no hooks, on the CPU):
            # the next plan applied to it must not find this one's hooks.
            if self._given:
                unapply(self.pipe, self.placed)
            elif self.placed is not None:
                self.placed.close()
            raise
        self.batch_size = self.plan.batch_size
        self._writer = _Writer()
        self.stats = {"shards": 0, "images": 0, "errors": 0, "generate_seconds": 0.0}
        self.info = {
            "worker": spec.name,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "device": describe_device(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "torch_threads": torch.get_num_threads(),
            "plan": self.plan.to_dict(),
            "probe": self.probe,
            "load_seconds": round(time.perf_counter() - started, 3),
            "versions": {"fleetgen": __version__, "torch": torch.__version__, "python": platform.python_version()},
        }
        self.write_info()

    def describe(self) -> dict:
        stats = dict(self.stats)
        secs = stats["generate_seconds"]
        stats["images_per_second"] = round(stats["images"] / secs, 4) if secs else None
        offload = self.offload_stats.snapshot()
        moved = sum(c["bytes_onloaded"] for c in offload["components"].values())
        # Transfers overlap compute under streams, so time in them is estimated from the probed
        # bandwidth rather than clocked (see bench/gpu_offload.py for achieved GB/s).
        offload["transfer_seconds_estimated"] = round(moved / self.probe["bandwidth"], 4)
        measured = secs / stats["images"] if stats["images"] else None
        compare = {"seconds_per_image": {"predicted": self.plan.seconds_per_image or None, "measured": measured},
                   "peak_device_bytes": {"predicted": self.plan.peak_bytes or None,
                                         "measured": offload.get("peak_device_bytes")}}
        return {**self.info, "plan": self.plan.to_dict(), "batch_size": self.batch_size, "stats": stats,
                "offload": offload, "predicted_vs_measured": compare, "step_downs": list(self.step_downs)}

    def write_info(self) -> None:
        """`OUT/workers/<w>.json`. A status record: when the store does not take it, the work goes
        on (the next shard writes it again)."""
        try:
            self.output.put(worker_key(self.spec.name), json.dumps(self.describe(), indent=2).encode())
        except StorageError as err:
            print(f"[fleetgen] {self.spec.name}: {worker_key(self.spec.name)} not written: {err}", flush=True)

    def run_shard(self, shard: Shard) -> ShardResult:
        """Generate a whole shard and commit it; returns its result."""
        *_, result = self.iter_shard(shard)
        return result

    def iter_shard(self, shard: Shard) -> Iterator[BatchDone | ShardResult]:
        """Generate `shard`, yielding a `BatchDone` per pipeline call, then the `ShardResult`.

        Images are written as they are made, under this attempt's own staging prefix; the
        manifest is written last and is the commit (workers/commit.py): the first attempt to
        commit wins, moves its objects to their final keys, and a losing attempt never touches
        them. An attempt stops at its next batch once another has committed. A shard with
        `retry_errors` is committed already: only its error images are made again, the rest of its
        manifest and its stored images are kept as they are, and a new manifest is committed.
        """
        started = time.perf_counter()
        name, attempt = self.spec.name, uuid.uuid4().hex[:12]
        table = read_shard(shard, self.spec.columns)
        images = shard_images(shard, table, self.spec.columns, self.recipe)
        records = {im.id: self._record(im) for im in images}
        for im in images:
            if im.error is None:
                self._check_length(im, records[im.id])
        base, kept = self._keep_committed(shard, records) if shard.retry_errors else (None, set())
        redo = {im.id for im in images if records[im.id]["status"] == "ok" and im.id not in kept}
        todo = [im for im in images if im.id in redo]
        counts = Counter(im.row for im in images)  # images per row, for progress in rows
        sink = self._open_sink(shard, table, base, attempt)
        won = unknown = False  # unknown: the commit may have landed; its staging must stay
        try:
            failures = 0
            for group in group_images(todo):
                i = 0
                while i < len(group):
                    if self._committed(shard, base):
                        self._give_up(sink, shard, attempt)
                        yield ShardResult(shard.id, name, 0, 0, time.perf_counter() - started, committed_by_other=True)
                        return
                    batch = group[i : i + self.batch_size]
                    i += len(batch)
                    made, failed = self._generate(batch)
                    # Counted before the writer thread takes the batch: it drops each picture once encoded.
                    filtered = sum(m.picture is None for m in made)  # flagged by a safety checker: not stored
                    # Encoding, hashing and storing run on the writer thread while the device makes the next batch.
                    self._writer.submit(self._encode_and_store, sink, made, records, table)
                    for image_id, error in failed.items():
                        records[image_id].update(status="error", error=error)
                    failures += len(failed)
                    yield BatchDone(shard.id, name, len(made) - filtered, len(failed) + filtered,
                                    rows=sum(1 / counts[im.row] for im in batch))
            if todo and failures == len(todo) and base is None:
                raise ShardError(f"Shard {shard.id}: every row failed in the pipeline; first error: "
                                 f"{records[todo[0].id]['error']}")
            self._writer.drain()  # every image written before the commit
            sink.close()
            final = [records[im.id] for im in images]
            shard_counts = counts_of(final, table.num_rows)
            manifest = self._manifest(final, table, [im.row for im in images], attempt, shard_counts)
            try:
                won = commit_manifest(self.output, shard.id, manifest, base)
            except StorageError as err:
                unknown = True
                raise ShardError(f"Shard {shard.id}: could not tell whether its commit landed ({err}); its staged "
                                 "objects are kept for the driver to finish or remove") from err
            if not won:
                self._give_up(sink, shard, attempt)
                yield ShardResult(shard.id, name, 0, 0, time.perf_counter() - started, committed_by_other=True)
                return
            try:
                version = self.output.version(manifest_key(shard.id))  # before the move: nothing else replaces it
            except StorageError:
                version = None  # the driver looks it up
            promote(self.output, shard.id, attempt, {r["image"] for r in final if r["image"]})
        finally:
            if not won and not unknown:  # lost, failed, or stopped (the generator closed): nothing of it stays
                self._give_up(sink, shard, attempt)
            elif unknown:
                self._writer.cancel()
        fresh = [r for i, r in records.items() if i not in kept]  # what this attempt decided
        ok = sum(r["status"] == "ok" for r in fresh)
        self.stats["shards"] += 1
        self.stats["images"] += ok
        self.stats["errors"] += len(fresh) - ok
        self.write_info()
        yield ShardResult(shard.id, name, ok, len(fresh) - ok, time.perf_counter() - started, counts=shard_counts,
                          version=version)

    def _give_up(self, sink, shard: Shard, attempt: str) -> None:
        """This attempt lost, failed or was stopped: abort what it opened, remove its staging. Never
        raises: it runs while an attempt's own error is on its way up (a store that is down would
        otherwise replace that error with its own), and staging it leaves is the driver's to remove."""
        self._writer.cancel()  # the writer thread lets go of the sink first
        try:
            sink.abort()
            discard(self.output, shard.id, attempt)
        except StorageError as err:
            print(f"[fleetgen] {self.spec.name}: staging of {shard.id} left for the driver to remove ({err})",
                  flush=True)

    def _open_sink(self, shard: Shard, table: pa.Table, base: bytes | None, attempt: str):
        s, carry = self.spec.settings, self.spec.columns.carry
        carried = table.select(list(carry)).schema.remove_metadata() if carry else None
        sink = open_sink(self.output, shard.id, s.output_format, s.image_format, carried, staging(shard.id, attempt))
        if base is not None:
            sink.keep_existing()  # a retry: the shard's stored images stay, byte for byte
        return sink

    def _keep_committed(self, shard: Shard, records: dict) -> tuple[bytes, set[str]]:
        """For a retry: take every committed record that is not an error as it is (its image stays
        where it is stored). Returns the committed manifest's bytes (if they change meanwhile,
        another attempt committed first) and the ids kept."""
        try:
            base = self.output.get(manifest_key(shard.id))
        except FileNotFoundError as err:
            raise ShardError(f"Shard {shard.id} has no committed manifest to retry the error rows of.") from err
        kept = set()
        for old in read_parquet(base, columns=MANIFEST_SCHEMA.names).to_pylist():
            if old["id"] in records and old["status"] != "error":
                records[old["id"]] = old
                kept.add(old["id"])
        return base, kept

    def _committed(self, shard: Shard, base: bytes | None = None) -> bool:
        if base is None:
            return self.output.exists(manifest_key(shard.id))
        try:
            return self.output.get(manifest_key(shard.id)) != base
        except FileNotFoundError:
            return False

    def _encode_and_store(self, sink, made: list[_Made], records: dict, table: pa.Table) -> None:
        """On the writer thread: encode and hash each image, then store the batch."""
        s = self.spec.settings
        for m in made:
            if m.picture is not None:
                m.data = encode(m.picture, s.image_format)
                m.picture = None  # the decoded image is not held longer than needed
                digest = hashlib.sha256(m.data).hexdigest()
                m.meta["sha256"] = digest
                m.record.update(sha256=digest, size=len(m.data))
        self._store(sink, made, records, table)

    def _store(self, sink, made: list[_Made], records: dict, table: pa.Table) -> None:
        kept = [m for m in made if m.data is not None]
        if kept:
            carry = self.spec.columns.carry
            carried = table.select(list(carry)).take([m.row for m in kept]) if carry else None
            stored = sink.add([(m.id, m.data, m.meta) for m in kept], carried)
            for m, (key, member) in zip(kept, stored, strict=True):
                records[m.id].update(m.record, image=key, member=member)
        for m in made:
            if m.data is None:
                records[m.id].update(m.record)

    def _record(self, im: Image) -> dict:
        look = im.look
        return {
            "id": im.id, "row_id": im.row_id, "image_index": im.index, "prompt": im.prompt,
            "negative_prompt": im.negative_prompt, "seed": im.seed,
            "status": "error" if im.error else "ok", "error": im.error, "warning": None, "image": None, "member": None,
            "nsfw": None, "sha256": None, "size": None, "width": look.width, "height": look.height, "steps": look.steps,
            "guidance": look.guidance, "lora": [a.source for a in look.adapters],
            "lora_scale": [a.scale for a in look.adapters], "template": self.recipe.template,
            "batch": None, "worker": self.spec.name, "device": self.info["device"]["name"], "seconds": None,
        }

    def _check_length(self, im: Image, record: dict) -> None:
        """Prompts longer than the text encoder that reads the whole prompt takes (T5 or Gemma
        where the family has one, else CLIP) are truncated by the pipeline: say so per image, or
        make it an error with `--strict-prompts`."""
        if im.negative_prompt and not self._takes_negative:
            record["warning"] = f"negative prompt ignored: {type(self.pipe).__name__} takes none"
        tokenizer, limit = prompt_limit(self.pipe, self.family)
        if tokenizer is None or not limit:
            return
        n = len(tokenizer(im.prompt, truncation=False).input_ids)
        if n <= limit:
            return
        if self.spec.strict_prompts:
            record.update(status="error", error=f"prompt is {n} tokens; the text encoder takes {limit} (`--strict-prompts`)")
        else:
            record["warning"] = "; ".join(filter(None, [record["warning"], f"prompt truncated to {limit} of {n} tokens"]))

    def _warm_up(self, look: Look) -> None:
        """One image through the pipeline, so that kernels, the allocator and the streams' prefetch
        order settle before anything is timed. An OOM here steps the plan down, as in a shard."""
        while True:
            oom = None
            try:
                with components_dtypes_kept(self.pipe):
                    self.pipe(**self._kwargs(["warm up"], [None], look, generator=None))
                torch.cuda.reset_peak_memory_stats(self.device)
                return
            except Exception as err:  # noqa: BLE001 - only an OOM is handled; the rest is raised
                if not is_out_of_memory(err):
                    raise
                oom = one_line(err)
            # outside the `except`: the failed call's frames, and the memory they hold, are gone
            if not self._step_down(1, oom):
                raise OffloadError(f"{self.spec.name}: out of memory warming up with the leanest plan: {oom}")

    def _generate(self, batch: list[Image]) -> tuple[list[_Made], dict[str, str]]:
        """Run one pipeline call; if it raises, run its images one at a time so that one bad row
        costs only itself. Returns what was made and `{image id: error message}`.

        Recovery runs after the `try` statement, never inside the `except`: an exception's traceback
        holds the frames of the failed call and every tensor they made, so inside the handler
        `empty_cache()` frees nothing and the retry would start with the failed attempt's memory
        still allocated (PyTorch FAQ, "My out of memory exception handler can't allocate memory")."""
        oom = failure = None
        try:
            return self._call(batch), {}
        except Exception as err:  # noqa: BLE001 - any pipeline failure is retried row by row
            if is_out_of_memory(err):
                oom = one_line(err)
            else:
                failure = f"{type(err).__name__}: {err}"
        if oom is not None:
            if not self._step_down(len(batch), oom):
                return [], {r.id: f"OutOfMemoryError at batch 1 with the leanest plan: {oom}" for r in batch}
            made, failed = [], {}
            for j in range(0, len(batch), self.batch_size):
                m, f = self._generate(batch[j : j + self.batch_size])
                made += m
                failed.update(f)
            return made, failed
        if len(batch) == 1:
            return [], {batch[0].id: failure}
        made, failed = [], {}
        for im in batch:
            m, f = self._generate([im])
            made += m
            failed.update(f)
        return made, failed

    def _step_down(self, size: int, err: str) -> bool:
        """After an out-of-memory error (`err`, its message): a smaller batch, else a leaner plan;
        kept for this worker. False when there is nothing leaner."""
        gc.collect()  # hook registries and pipeline outputs form reference cycles
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        if size > 1:
            before, self.batch_size = self.batch_size, max(1, min(self.batch_size, size) // 2)
            self.step_downs.append({"from": f"batch {before}", "to": f"batch {self.batch_size}",
                                    "reason": f"out of memory at batch {size}"})
            return True
        try:
            leaner = leaner_plan(self.profile, self.plan, self.device, self.probe, **self._fit)
        except FleetgenError:
            return False
        self._reapply(leaner)
        self.step_downs.append({"from": self.plan.to_dict()["modes"], "to": leaner.to_dict()["modes"],
                                "reason": f"out of memory at batch 1: {err[:200]}"})
        self.plan = leaner
        return True

    def _reapply(self, new_plan) -> None:
        self.offload_stats.close()
        unapply(self.pipe, self.placed)  # every hook, the stream ones included
        self.placed = apply(self.pipe, new_plan, self.profile, self.device, tag=self.spec.name)
        self.offload_stats = OffloadStats(pipeline_modules(self.pipe), self.device)

    def _kwargs(self, prompts: list[str], negatives: list[str | None], look: Look, generator) -> dict:
        return call_kwargs(self.pipe, self.family, prompts, negatives, steps=look.steps, guidance=look.guidance,
                           width=look.width, height=look.height, true_cfg_scale=self.spec.settings.true_cfg_scale,
                           generator=generator)

    def _call(self, batch: list[Image]) -> list[_Made]:
        look = batch[0].look
        started = time.perf_counter()
        if look.adapters != self._active:  # between batches only: a batch shares its look
            activate_adapters(self.pipe, self.adapters, look.adapters)
            self._active = look.adapters
        with components_dtypes_kept(self.pipe):
            out = self.pipe(**self._kwargs([im.prompt for im in batch], [im.negative_prompt for im in batch], look,
                                           generators([im.seed for im in batch])))
        # A safety checker (SD 1.x) blacks out what it flags: such images are `filtered`, not stored.
        flags = getattr(out, "nsfw_content_detected", None) or [None] * len(batch)
        made = []
        for im, image, flagged in zip(batch, out.images, flags, strict=True):
            if flagged:
                made.append(_Made(im.id, im.row, None, {}, {"status": "filtered", "nsfw": True, "batch": len(batch),
                                                            "error": "flagged by the pipeline's safety checker; not stored"}))
                continue
            meta = {"id": im.id, "row_id": im.row_id, "image_index": im.index, "prompt": im.prompt,
                    "negative_prompt": im.negative_prompt, "seed": im.seed, "width": look.width, "height": look.height,
                    "steps": look.steps, "guidance": look.guidance, "lora": [a.source for a in look.adapters],
                    "lora_scale": [a.scale for a in look.adapters], "nsfw": flagged, "model": self.spec.model}
            made.append(_Made(im.id, im.row, image, meta, {"batch": len(batch), "nsfw": flagged}))
        seconds = time.perf_counter() - started
        self.stats["generate_seconds"] += seconds
        for m in made:
            m.record["seconds"] = seconds / len(batch)
        return made

    def _manifest(self, records: list[dict], table: pa.Table, rows: list[int], attempt: str, counts: dict) -> bytes:
        """The manifest: one row per image, then the carried input columns of each image's row;
        its metadata names the attempt whose objects it names."""
        manifest = pa.Table.from_pylist(records, schema=MANIFEST_SCHEMA)
        for name in self.spec.columns.carry:
            manifest = manifest.append_column(table.schema.field(name), table.column(name).take(rows))
        manifest = manifest.replace_schema_metadata({ATTEMPT_KEY: attempt.encode(), COUNTS_KEY: json.dumps(counts)})
        buf = io.BytesIO()
        pq.write_table(manifest, buf)
        return buf.getvalue()

    def close(self) -> None:
        self._writer.close()
        self.offload_stats.close()
        if self._given:
            unapply(self.pipe, self.placed)
        else:
            self.placed.close()
        self.pipe = None


@dataclass
class _Made:
    id: str
    row: int  # its row in the shard's table
    picture: object | None  # the decoded image until the writer encodes it; None when the safety checker filtered it
    meta: dict  # what webdataset/parquet output stores beside it
    record: dict
    data: bytes | None = None  # the encoded image (set by the writer)


class _Writer:
    """One background thread that encodes, hashes and stores a worker's images while the device
    makes the next batch. At most `depth` batches wait for it: a slow store slows the pipeline
    (back-pressure) instead of filling memory with decoded images. Errors surface in the caller."""

    def __init__(self, depth: int = WRITE_AHEAD):
        self.depth, self.pending = depth, deque()
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fleetgen-writer")

    def submit(self, fn, *args) -> None:
        if self.depth == 0:  # inline, on the caller's thread (what bench/worker_overlap.py compares with)
            fn(*args)
            return
        while len(self.pending) >= self.depth:
            self.pending.popleft().result()
        self.pending.append(self.pool.submit(fn, *args))

    def drain(self) -> None:
        """Wait for every batch handed over; raises the first error."""
        while self.pending:
            self.pending.popleft().result()

    def cancel(self) -> None:
        """Drop batches not started, wait for the one running; errors are ignored (giving up)."""
        while self.pending:
            future = self.pending.popleft()
            if not future.cancel():
                try:
                    future.result()
                except Exception:  # noqa: BLE001, S110 - the attempt is being abandoned anyway
                    pass

    def close(self) -> None:
        self.cancel()
        self.pool.shutdown(wait=True)

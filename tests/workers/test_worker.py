"""The worker on CPU with the tiny model, no Ray: what a shard writes, in every output format."""

import hashlib
import io
import json
import tarfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

import fleetgen.workers.pipeline.applied
from fleetgen.jobs.sharding import plan_shards, read_footer, resolve_columns
from fleetgen.workers.output.layout import MANIFEST_SCHEMA
from fleetgen.workers.rows.batches import Look
from fleetgen.workers.rows.shard import Columns
from fleetgen.workers.spec import GenerationSettings, ShardResult, WorkerSpec
from fleetgen.workers.worker import Worker
from tests.conftest import FAST, write_prompts

PROMPTS = ["a red fox", None, "a blue owl in the forest", "sunset over the sea", "a small robot"]
IDS = ["fox", "null", "owl", "sea", "../escape"]


@pytest.fixture(scope="module")
def shard_input(tmp_path_factory):
    path = write_prompts(tmp_path_factory.mktemp("in") / "p.parquet", PROMPTS, id=IDS)
    files = [read_footer(str(path))]
    return plan_shards(files, 100)[0], resolve_columns(files, Columns())


def make_worker(model, out, output_format="files", max_batch=2, image_format="png"):
    settings = GenerationSettings(
        family="sd",
        task="text-to-image",
        steps=FAST["steps"],
        guidance=FAST["guidance"],
        width=64,
        height=64,
        seed=0,
        image_format=image_format,
        output_format=output_format,
    )
    cols = Columns.of("prompt", "id", None, None)
    return Worker(WorkerSpec.of("w0", model, str(out), settings, cols, max_batch=max_batch, device="cpu", threads=2))


def manifest(out, shard_id="shard-00000"):
    return pq.read_table(out / "shards" / f"{shard_id}.parquet")


def test_files_output_and_manifest(tiny_model, shard_input, tmp_path):
    shard, _ = shard_input
    worker = make_worker(tiny_model, tmp_path)
    events = list(worker.iter_shard(shard))
    result = events[-1]
    assert isinstance(result, ShardResult) and (result.ok, result.errors) == (3, 2)
    assert [e.images for e in events[:-1]] == [2, 1]  # batches of max_batch=2 over the 3 good rows

    table = manifest(tmp_path)
    assert table.schema.equals(MANIFEST_SCHEMA)
    rows = table.to_pylist()
    assert [r["id"] for r in rows] == IDS  # one row per input row, in input order
    assert [r["status"] for r in rows] == ["ok", "error", "ok", "ok", "error"]
    assert rows[1]["error"] == "prompt is null or empty"
    assert "not safe as an object key" in rows[4]["error"]
    for r in rows:
        if r["status"] == "ok":
            data = (tmp_path / r["image"]).read_bytes()
            assert r["image"] == f"images/shard-00000/{r['id']}.png"
            assert hashlib.sha256(data).hexdigest() == r["sha256"]
            assert Image.open(io.BytesIO(data)).size == (64, 64)
            assert r["seed"] is not None and r["worker"] == "w0" and r["seconds"] > 0
    # nothing outside the shard's prefix, nothing for the bad rows
    written = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert written == [
        "images/shard-00000/fox.png",
        "images/shard-00000/owl.png",
        "images/shard-00000/sea.png",
        "shards/shard-00000.parquet",
        "workers/w0.json",
    ]
    stats = json.loads((tmp_path / "workers" / "w0.json").read_text())
    assert stats["stats"]["images"] == 3 and stats["plan"]["batch_size"] == 2


@pytest.mark.parametrize("depth", [0, 2])
def test_progress_counts_every_image_whether_stored_inline_or_behind(tiny_model, shard_input, tmp_path, depth):
    """The writer drops each picture once encoded: a batch's images are counted before it takes
    them (inline, depth 0, it always has by then; behind, it may have: a race CI once lost)."""
    from fleetgen.workers.output.writer import Writer

    shard, _ = shard_input
    worker = make_worker(tiny_model, tmp_path)
    worker._writer = Writer(depth)
    events = list(worker.iter_shard(shard))
    assert [(e.images, e.errors) for e in events[:-1]] == [(2, 0), (1, 0)]
    assert (events[-1].ok, events[-1].errors) == (3, 2)


def test_same_shard_twice_gives_same_bytes(tiny_model, shard_input, tmp_path):
    shard, _ = shard_input
    worker = make_worker(tiny_model, tmp_path / "a")
    worker.run_shard(shard)
    first = manifest(tmp_path / "a").column("sha256").to_pylist()
    worker.run_shard(shard)  # a retry overwrites the same keys
    assert manifest(tmp_path / "a").column("sha256").to_pylist() == first
    assert len(list((tmp_path / "a" / "images" / "shard-00000").iterdir())) == 3


def test_batch_size_changes_low_bits_only(tiny_model, shard_input, tmp_path):
    """Batched kernels on CPU may round differently per batch shape: images agree to a few levels."""
    shard, _ = shard_input
    arrays = []
    for batch in (1, 3):
        make_worker(tiny_model, tmp_path / f"b{batch}", max_batch=batch).run_shard(shard)
        arrays.append(
            [
                np.asarray(Image.open(tmp_path / f"b{batch}" / "images" / "shard-00000" / f"{i}.png"), dtype=np.int16)
                for i in ("fox", "owl", "sea")
            ]
        )
    for a, b in zip(*arrays, strict=True):
        assert np.abs(a - b).max() <= 2


def test_webdataset_output(tiny_model, shard_input, tmp_path):
    shard, _ = shard_input
    make_worker(tiny_model, tmp_path, output_format="webdataset", image_format="jpeg").run_shard(shard)
    rows = {r["id"]: r for r in manifest(tmp_path).to_pylist()}
    with tarfile.open(tmp_path / "data" / "shard-00000.tar") as tar:
        names = tar.getnames()
        assert names == ["fox.jpg", "fox.json", "owl.jpg", "owl.json", "sea.jpg", "sea.json"]
        meta = json.loads(tar.extractfile("owl.json").read())
        data = tar.extractfile("owl.jpg").read()
    assert meta["prompt"] == "a blue owl in the forest" and meta["seed"] == rows["owl"]["seed"]
    assert hashlib.sha256(data).hexdigest() == rows["owl"]["sha256"] == meta["sha256"]
    assert (rows["owl"]["image"], rows["owl"]["member"]) == ("data/shard-00000.tar", "owl.jpg")
    assert Image.open(io.BytesIO(data)).format == "JPEG"


def test_parquet_output_reads_with_pyarrow_and_datasets(tiny_model, shard_input, tmp_path):
    shard, _ = shard_input
    make_worker(tiny_model, tmp_path, output_format="parquet", image_format="webp").run_shard(shard)
    path = tmp_path / "data" / "shard-00000.parquet"
    table = pq.read_table(path)
    assert table.column("id").to_pylist() == ["fox", "owl", "sea"]
    data = table.column("image").to_pylist()[0]["bytes"]
    assert hashlib.sha256(data).hexdigest() == manifest(tmp_path).column("sha256").to_pylist()[0]
    assert Image.open(io.BytesIO(data)).format == "WEBP"

    datasets = pytest.importorskip("datasets")
    ds = datasets.load_dataset("parquet", data_files=str(path), split="train")
    assert ds[1]["id"] == "owl" and ds[1]["image"].size == (64, 64)  # decoded as an Image feature


def test_seed_column_is_used(tiny_model, tmp_path):
    """Two rows with the same prompt and the same seed make the same image; another seed does not."""
    path = write_prompts(tmp_path / "p.parquet", ["a cat"] * 3, id=["a", "b", "c"], seed=pa.array([9, 9, 10]))
    files = [read_footer(str(path))]
    shard = plan_shards(files, 10)[0]
    settings = GenerationSettings(family="sd", task="text-to-image", steps=2, guidance=5.0, width=64, height=64)
    cols = resolve_columns(files, Columns())
    Worker(WorkerSpec.of("w0", tiny_model, str(tmp_path / "o"), settings, cols, max_batch=1, device="cpu")).run_shard(
        shard
    )
    rows = manifest(tmp_path / "o").to_pylist()
    assert [r["seed"] for r in rows] == [9, 9, 10]
    assert rows[0]["sha256"] == rows[1]["sha256"] != rows[2]["sha256"]


def test_budget_on_cpu_plans_offload_and_keeps_images(tiny_model, shard_input, tmp_path):
    """A CPU worker told it has a small GPU plans (and applies) offloading exactly as a GPU worker
    would; the images are the same bytes as from an all-resident worker at the same batch size."""
    shard, _ = shard_input
    settings = GenerationSettings(family="sd", task="text-to-image", steps=2, guidance=5.0, width=64, height=64)
    cols = Columns.of("prompt", "id", None, None)
    resident = Worker(WorkerSpec.of("w0", tiny_model, str(tmp_path / "a"), settings, cols, max_batch=1, device="cpu"))
    small = Worker(
        WorkerSpec.of(
            "w1", tiny_model, str(tmp_path / "b"), settings, cols, max_batch=1, device="cpu", gpu_memory=20 * 2**20
        )
    )
    assert set(resident.plan.modes.values()) == {"resident"}
    assert small.plan.modes["unet"] != "resident"
    # a CUDA worker warms up before its first shard (here, on the CPU, called as it would be there):
    # those transfers are no image's and the stats do not count them (bytes ÷ generate seconds)
    small.fitted._warm_up(Look(64, 64, 1, 5.0))
    assert small.fitted.offload_stats.snapshot()["components"]["unet"]["onloads"] == 0
    resident.run_shard(shard)
    small.run_shard(shard)
    assert (
        manifest(tmp_path / "a").column("sha256").to_pylist() == manifest(tmp_path / "b").column("sha256").to_pylist()
    )
    info = json.loads((tmp_path / "b" / "workers" / "w1.json").read_text())
    assert info["plan"]["peak_bytes"] <= 20 * 2**20 and "predicted peak" in info["plan"]["reason"]
    unet = info["offload"]["components"]["unet"]
    assert unet["onloads"] == 3 * 2 * unet["groups"]  # 3 images, 2 steps each, every group once per step
    assert info["offload"]["rss_bytes"] > 0 and info["offload"]["transfer_seconds_estimated"] > 0
    compare = info["predicted_vs_measured"]["seconds_per_image"]
    assert compare["predicted"] > 0 and compare["measured"] > 0
    small.close()


def test_nothing_fits_fails_at_worker_start(tiny_model, tmp_path):
    from fleetgen.errors import OffloadError

    settings = GenerationSettings(family="sd", task="text-to-image", steps=2, guidance=5.0, width=64, height=64)
    with pytest.raises(OffloadError, match="Nothing fits 1.0 MiB on cpu"):
        Worker(WorkerSpec.of("w0", tiny_model, str(tmp_path), settings, Columns(), device="cpu", gpu_memory=2**20))


def test_out_of_memory_steps_down_batch_then_plan(tiny_model, shard_input, tmp_path):
    """A real `torch.OutOfMemoryError`, raised by a forward hook on the UNet (the fault injected),
    makes the worker halve its batch, then move to a leaner plan; both are kept and recorded."""
    import torch

    shard, _ = shard_input
    settings = GenerationSettings(family="sd", task="text-to-image", steps=2, guidance=5.0, width=64, height=64)
    worker = Worker(
        WorkerSpec.of(
            "w0",
            tiny_model,
            str(tmp_path),
            settings,
            Columns.of("prompt", "id", None, None),
            max_batch=2,
            device="cpu",
            gpu_memory=2**30,
        )
    )
    assert worker.batch_size == 2 and set(worker.plan.modes.values()) == {"resident"}

    from fleetgen.offload.stats import find_groups

    def fail_while_resident(module, args):
        if not find_groups(module):
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    worker.pipe.unet.register_forward_pre_hook(fail_while_resident)
    result = worker.run_shard(shard)
    assert (result.ok, result.errors) == (3, 2)
    assert worker.batch_size == 1 and worker.plan.modes["unet"] != "resident"
    reasons = [d["reason"].split(":")[0] for d in worker.step_downs]
    assert reasons[0] == "out of memory at batch 2" and (worker.step_downs[0]["to"] == "batch 1")
    assert len(reasons) >= 2 and set(reasons[1:]) == {"out of memory at batch 1"}  # leaner plans until the UNet moves
    info = json.loads((tmp_path / "workers" / "w0.json").read_text())
    assert info["step_downs"] == worker.step_downs and info["plan"]["modes"]["unet"] != "resident"


def test_after_an_oom_the_rest_of_the_batch_runs_at_the_size_stepped_down_to(tiny_model, tmp_path):
    """A batch of 4 that runs out of memory is halved; the first half runs out too and is halved
    again: the second half then runs at that size, not at the 2 it was cut to (on the first CUDA
    run SDXL's forced OOM spent two more OOMs, recorded as "batch 1 -> batch 1", on stale halves)."""
    import torch

    path = write_prompts(tmp_path / "p.parquet", [f"a red fox {i}" for i in range(4)])
    files = [read_footer(str(path))]
    shard = plan_shards(files, 100)[0]
    settings = GenerationSettings(family="sd", task="text-to-image", steps=1, guidance=5.0, width=32, height=32)
    worker = Worker(
        WorkerSpec.of(
            "w0", tiny_model, str(tmp_path / "out"), settings, Columns.of("prompt", None, None, None), max_batch=4
        )
    )
    sizes = []

    def one_image_at_a_time(module, args):  # a batch of one image is 2 rows with guidance
        sizes.append(args[0].shape[0])
        if args[0].shape[0] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    worker.pipe.unet.register_forward_pre_hook(one_image_at_a_time)
    assert worker.run_shard(shard).ok == 4
    assert [(d["from"], d["to"]) for d in worker.step_downs] == [("batch 4", "batch 2"), ("batch 2", "batch 1")]
    assert sizes == [8, 4, 2, 2, 2, 2]  # every image once at batch 1, after one failed call at 4 and one at 2
    worker.close()


def test_a_workers_offload_stats_count_its_whole_run_across_a_re_applied_plan(tiny_model, shard_input, tmp_path):
    """An OOM at batch 1 re-applies a leaner plan with new stats: the worker's file still counts the
    transfers made before it (every offloaded weight moves once per forward, whatever the grouping)."""
    import torch

    shard, _ = shard_input
    settings = GenerationSettings(family="sd", task="text-to-image", steps=2, guidance=5.0, width=64, height=64)
    cols = Columns.of("prompt", "id", None, None)
    worker = Worker(
        WorkerSpec.of("w0", tiny_model, str(tmp_path), settings, cols, max_batch=1, device="cpu", gpu_memory=20 * 2**20)
    )
    assert worker.plan.modes["unet"] != "resident"
    calls = []

    def oom_in_the_second_image(module, args):
        calls.append(1)
        if len(calls) == 3:  # the second image's first step: the first image's two forwards are counted
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    worker.pipe.unet.register_forward_pre_hook(oom_in_the_second_image)
    assert worker.run_shard(shard).ok == 3
    assert isinstance(worker.step_downs[0]["to"], dict)  # a leaner plan, re-applied mid-shard
    unet = json.loads((tmp_path / "workers" / "w0.json").read_text())["offload"]["components"]["unet"]
    assert unet["bytes_onloaded"] == 3 * 2 * worker.profile.components["unet"].bytes  # 3 images, 2 steps each
    worker.close()


def test_a_plan_step_down_records_what_changed_beside_the_placements(tiny_model, tmp_path):
    """FLUX.1-dev's forced OOM on the H200 stepped down from all resident to the same placements with its
    text encoders in a phase of their own, recorded as modes only: "from" and "to" read the same."""
    from dataclasses import replace

    from fleetgen.workers.pipeline.recovery import _rung

    settings = GenerationSettings(family="sd", task="text-to-image", steps=1, guidance=5.0, width=32, height=32)
    plan = Worker(WorkerSpec.of("w0", tiny_model, str(tmp_path), settings, Columns(), device="cpu")).plan
    phased = replace(plan, phases=(("text_encoder",), ("unet", "vae")), chunk=4)
    quantized = replace(plan, formats={"unet": "int8"})
    assert _rung(plan) == plan.modes
    assert _rung(phased) == {**plan.modes, "phases": "text_encoder | unet+vae"} != _rung(plan)
    assert _rung(quantized)["formats"] == "unet=int8"


@pytest.mark.slow  # builds a tiny SDXL: seconds
def test_an_oom_in_the_sdxl_decode_leaves_the_vae_as_it_was(shard_input, tmp_path):
    """SDXL's pipeline casts its float16 VAE to float32 for the decode and back only on success: an
    OOM in the decode once left it float32, and every later call failed ("Input type (c10::Half)
    and bias type (float)"), the whole shard with it. Now the step-down's smaller batch succeeds."""
    import torch

    from fleetgen.workers.tiny.sd import build_tiny_sdxl

    shard, _ = shard_input
    pipe = build_tiny_sdxl(0).to(torch.float16)
    settings = GenerationSettings(task="text-to-image", steps=2, guidance=5.0, width=64, height=64, family="sdxl")
    worker = Worker(
        WorkerSpec.of(
            "w0",
            "tiny-sdxl",
            str(tmp_path),
            settings,
            Columns.of("prompt", "id", None, None),
            max_batch=3,
            device="cpu",
            dtype="float16",
        ),
        pipe=pipe,
    )
    assert worker.profile.components["vae"].upcast and worker.profile.dtype_bytes == 2
    calls = []

    def oom_in_the_first_decode(module, args):
        calls.append(module.conv_in.weight.dtype)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (injected in the VAE decode)")

    worker.pipe.vae.decoder.register_forward_pre_hook(oom_in_the_first_decode)
    result = worker.run_shard(shard)
    assert (result.ok, result.errors) == (3, 2), worker.step_downs
    assert calls[0] == torch.float32  # the decode does run upcast ...
    assert worker.pipe.vae.dtype == torch.float16  # ... and the VAE is back where it was
    assert worker.step_downs[0]["reason"].startswith("out of memory at batch 3")
    worker.close()


def test_an_oom_retry_starts_with_the_failed_attempts_memory_freed(tiny_model, shard_input, tmp_path):
    """The step-down and retry run after the `except`: the failed call's frames (and tensors) are gone
    by then, so `empty_cache()` can release them. Inside the handler the traceback kept them alive."""
    import weakref

    import torch

    shard, _ = shard_input
    worker = make_worker(tiny_model, tmp_path, max_batch=2)
    held: list[weakref.ref] = []
    alive_at_retry: list[bool] = []

    def fail_once(module, args):
        if not held:
            activations = torch.empty(1 << 20)  # what a failed forward holds when the OOM is raised
            held.append(weakref.ref(activations))
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        if not alive_at_retry:
            alive_at_retry.append(held[0]() is not None)

    worker.pipe.unet.register_forward_pre_hook(fail_once)
    assert worker.run_shard(shard).ok == 3
    assert alive_at_retry == [False]


def test_an_oom_raised_as_a_runtime_error_steps_down_too(tiny_model, shard_input, tmp_path):
    """cuBLAS/cuDNN workspaces and pinning host memory fail with a plain RuntimeError."""
    shard, _ = shard_input
    worker = make_worker(tiny_model, tmp_path, max_batch=2)
    raised = []

    def fail_once(module, args):
        if not raised:
            raised.append(1)
            raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")

    worker.pipe.unet.register_forward_pre_hook(fail_once)
    assert worker.run_shard(shard).ok == 3
    assert worker.step_downs and worker.step_downs[0]["to"] == "batch 1"


def test_a_worker_that_cannot_start_leaves_a_given_pipeline_without_hooks(tmp_path):
    """bench/gpu_check.py hands one pipeline to many workers: one that fails after applying its plan
    must not leave its hooks (the next plan would keep them) or its parts on the device."""
    from fleetgen.errors import OffloadError
    from fleetgen.offload.hooks import offload_hooks
    from fleetgen.workers.tiny.flux import build_tiny_flux

    pipe = build_tiny_flux()
    settings = GenerationSettings(task="text-to-image", steps=2, guidance=3.5, width=64, height=64, family="flux")
    spec = WorkerSpec.of(
        "w0",
        "tiny-flux",
        str(tmp_path),
        settings,
        Columns.of("prompt", "id", None, None),
        device="cpu",
        offload="block",
        gpu_memory=2**30,
    )

    real = fleetgen.workers.pipeline.applied.OffloadStats

    def failing(*args, **kwargs):  # fails after the plan was applied, as a warm-up OOM would
        raise OffloadError("injected: could not start")

    fleetgen.workers.pipeline.applied.OffloadStats = failing
    try:
        with pytest.raises(OffloadError, match="injected"):
            Worker(spec, pipe=pipe)
    finally:
        fleetgen.workers.pipeline.applied.OffloadStats = real
    assert offload_hooks(pipe) == 0
    Worker(spec, pipe=pipe).close()  # the same pipeline takes a plan again
    assert offload_hooks(pipe) == 0


@pytest.mark.parametrize("strict", [False, True])
def test_long_prompts_are_truncated_and_noted_or_refused(tiny_model, tmp_path, strict):
    long = " ".join(["a red fox in the forest"] * 20)  # 120 words: more than CLIP's 77 tokens
    path = write_prompts(tmp_path / "p.parquet", ["a cat", long], id=["short", "long"])
    files = [read_footer(str(path))]
    spec = WorkerSpec.of(
        "w0",
        tiny_model,
        str(tmp_path / "o"),
        GenerationSettings(family="sd", task="text-to-image", steps=2, guidance=7.5, width=64, height=64),
        resolve_columns(files, Columns()),
        device="cpu",
        strict_prompts=strict,
    )
    Worker(spec).run_shard(plan_shards(files, 10)[0])
    rows = {r["id"]: r for r in manifest(tmp_path / "o").to_pylist()}
    assert rows["short"]["status"] == "ok" and rows["short"]["warning"] is None
    if strict:
        assert rows["long"]["status"] == "error"
        assert rows["long"]["error"] == "prompt is 122 tokens; the text encoder takes 77 (`--strict-prompts`)"
    else:
        assert rows["long"]["status"] == "ok" and rows["long"]["warning"] == "prompt truncated to 77 of 122 tokens"


def test_encoding_and_storing_overlap_the_next_pipeline_call(tiny_model, tmp_path):
    """The writer thread stores batch k while the pipeline makes batch k+1; at most WRITE_AHEAD
    batches wait for it; the commit waits for all of them."""
    import threading
    import time as clock

    from fleetgen.workers.output.writer import WRITE_AHEAD

    path = write_prompts(tmp_path / "p.parquet", [f"prompt {i}" for i in range(8)], id=[f"i{i}" for i in range(8)])
    files = [read_footer(str(path))]
    worker = make_worker(tiny_model, tmp_path / "out", max_batch=1)
    events, store = [], worker._encode_and_store
    pipe = worker.pipe

    def call(**kwargs):
        events.append(("call", kwargs["prompt"][0], clock.monotonic()))
        return pipe(**kwargs)

    def slow_store(*args):
        clock.sleep(0.3)  # a slow store: the pipeline must not wait for it (up to WRITE_AHEAD batches)
        store(*args)
        events.append(("stored", args[1][0].id, clock.monotonic(), threading.current_thread().name))

    worker.fitted.pipe = call
    worker._encode_and_store = slow_store
    result = worker.run_shard(plan_shards(files, 100)[0])
    assert (result.ok, result.errors) == (8, 0)
    calls = [e for e in events if e[0] == "call"]
    stored = [e for e in events if e[0] == "stored"]
    assert all(e[3].startswith("fleetgen-writer") for e in stored)
    assert calls[1][2] < stored[0][2]  # the second image was being made before the first was stored
    for k, (_, _, at) in enumerate(calls):  # back-pressure: call k waits until batch k - WRITE_AHEAD - 1 is stored
        if k > WRITE_AHEAD:
            assert at >= stored[k - WRITE_AHEAD - 1][2]
    rows = manifest(tmp_path / "out").to_pylist()
    assert len(rows) == 8 and all(r["sha256"] and r["size"] for r in rows)  # committed after every store


def test_a_worker_loads_its_pipeline_with_the_collector_paused(tiny_model, tmp_path, monkeypatch):
    """The pipeline's load (on a worker's first, most of diffusers' and transformers' imports) runs
    with the cyclic collector off and sets off no collection (fleetgen/imports.py); on after it."""
    import gc

    import fleetgen.workers.worker

    seen, collections = [], []

    class Watched(fleetgen.workers.worker.FittedPipeline):
        def __init__(self, *args):
            seen.append(gc.isenabled())
            before = len(collections)
            super().__init__(*args)
            seen.append(len(collections) - before)

    def counted(phase, info):
        if phase == "start":
            collections.append(info["generation"])

    monkeypatch.setattr(fleetgen.workers.worker, "FittedPipeline", Watched)
    gc.callbacks.append(counted)
    try:
        make_worker(tiny_model, tmp_path / "out").close()
    finally:
        gc.callbacks.remove(counted)
    assert seen == [False, 0] and gc.isenabled()

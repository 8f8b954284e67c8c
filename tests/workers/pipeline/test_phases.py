"""Phased generation on CPU workers (workers/pipeline/phases.py, offload/phasing.py): tiny real-class
pipelines at a budget where the whole pipeline does not fit but each phase does, so per batch the
text encoder is offloaded and moved for every call, phased it moves once per chunk; the images are
the per-batch run's, byte for byte."""

from dataclasses import replace

import pyarrow.parquet as pq
import pytest
import torch

from fleetgen.jobs.sharding import plan_shards, read_footer, resolve_columns
from fleetgen.offload import DeviceSpec, plan, profile_pipeline
from fleetgen.offload.cost import MARGIN
from fleetgen.workers.families.table import DECODE_APART
from fleetgen.workers.rows.shard import Columns
from fleetgen.workers.spec import GenerationSettings, WorkerSpec
from fleetgen.workers.tiny.registry import TINY_FAMILIES
from fleetgen.workers.worker import Worker
from tests.conftest import FAST, write_prompts

# bytes given to the tiny text encoder and denoiser (as the 2026 models' are, both large beside the rest),
# so that where they live matters to the plan
BALLAST = {"text_encoder": 64 << 20, "transformer": 48 << 20}
# a clip's frames stored as PNG too: they are what phasing must keep (its H.264 bytes are compared by
# frames: x264 has been seen to encode the same frames differently once in a while on the writer thread)
VIDEO = {"task": "text-to-video", "num_frames": 5, "height": 48, "fps": 16.0, "store_frames": True}


def _settings(family: str, **over) -> GenerationSettings:
    video = VIDEO if family.startswith("wan") or family.startswith("hunyuanvideo") else {}
    base = {k: FAST[k] for k in ("steps", "guidance", "width", "height")}
    return GenerationSettings(family=family, output_format="files", **{**base, **video, **over})


def _pipeline(family: str):
    """The tiny pipeline with a weight-sized buffer on its text encoder and its denoiser: moved by
    offloading as weights are."""
    pipe = TINY_FAMILIES[family](0)
    for name, size in BALLAST.items():
        getattr(pipe, name).register_buffer("ballast", torch.zeros(size // 4), persistent=False)
    return pipe


def _budget(pipe, settings: GenerationSettings, max_batch: int) -> int:
    """A device budget between what phased needs (each phase alone) and what per batch needs with everything
    resident: per batch must offload, phased need not."""
    profile = profile_pipeline(pipe, "tiny")
    work = settings.workload(max_batch)
    roomy = DeviceSpec(budget=1 << 40, host_budget=1 << 34)
    whole = plan(profile, roomy, replace(work, phases="off")).peak_bytes
    phased = plan(profile, roomy, replace(work, phases="on")).peak_bytes
    assert phased < whole
    return int((whole + phased) / 2 / (1 - MARGIN))


def _run(pipe, settings, tmp_path, name, rows: list[str], **spec):
    path = tmp_path / "prompts.parquet"
    if not path.exists():
        write_prompts(path, rows, id=[f"r{i}" for i in range(len(rows))])
    files = [read_footer(str(path))]
    out = tmp_path / name
    worker = Worker(
        WorkerSpec(
            "w0", "tiny", str(out), settings, resolve_columns(files, Columns()), device="cpu", threads=1, **spec
        ),
        pipe,
    )
    try:
        for shard in plan_shards(files, 100):
            worker.run_shard(shard)
        info = worker.describe()
    finally:
        worker.close()
    manifest = pq.read_table(out / "shards").to_pylist()
    assert all(r["status"] == "ok" for r in manifest)
    # every image, and every frame of a clip (PNG), by its key
    return info, {str(p.relative_to(out)): p.read_bytes() for p in sorted((out / "images").rglob("*.png"))}


@pytest.mark.parametrize(
    "family",
    ["flux", *(pytest.param(f, marks=pytest.mark.slow) for f in ("flux2-klein", "qwen-image", "z-image-turbo", "wan"))],
)
def test_the_text_encoder_moves_once_per_chunk_and_the_images_are_the_per_batch_ones(family, tmp_path):
    pipe, settings = _pipeline(family), _settings(family)
    # batch 1, between both phases' peak and the whole's: per batch the text encoder (moved once per call)
    # or the transformer (once per step) must be offloaded
    budget = _budget(pipe, settings, max_batch=1)
    rows = [f"a lighthouse at dusk, number {i}" for i in range(4)]
    per_batch, per_batch_images = _run(
        pipe, settings, tmp_path, "per-batch", rows, max_batch=1, gpu_memory=budget, phases="off"
    )
    phased, phased_images = _run(pipe, settings, tmp_path, "phased", rows, max_batch=1, gpu_memory=budget)

    # per batch the text encoder does not fit beside the rest: offloaded, moved for every call (4 of them)
    assert per_batch["plan"]["modes"]["text_encoder"] != "resident"
    assert per_batch["offload"]["components"]["text_encoder"]["onloads"] >= 4
    # `auto` chose phased: the text encoder resident in its phase, moved onto the device once for the one chunk
    assert phased["plan"]["phases"][0][0] == "text_encoder" and phased["plan"]["modes"]["text_encoder"] == "resident"
    assert phased["phases"]["chunks"] == 1
    assert phased["offload"]["components"]["text_encoder"]["onloads"] == 1
    assert phased["offload"]["components"]["text_encoder"]["swaps"] == 1
    assert phased["plan"]["moved_bytes_per_image"] < per_batch["plan"]["moved_bytes_per_image"]
    assert phased["phases"]["encoded_again"] == 0
    # the VAE decodes in a phase of its own (the family's table: `decode_apart`), moved on once too
    assert len(phased["plan"]["phases"]) == 3 and phased["plan"]["phases"][2] == ["vae"]
    assert phased["offload"]["components"]["vae"]["swaps"] == 1
    assert phased_images == per_batch_images  # the same calls, the same decodes: the same bytes


@pytest.mark.slow
def test_repeated_prompts_are_encoded_once_per_chunk(tmp_path):
    """4 prompts x 8 images: each prompt encoded once (the pipeline repeats it for its images), each
    batch of one prompt answered once; the images as per batch, within the rounding of an encoder run
    on 1 prompt instead of 4."""
    import numpy as np
    from PIL import Image

    pipe, settings = _pipeline("flux"), _settings("flux", images_per_prompt=8)
    rows = [f"a red fox, style {i}" for i in range(4)]
    common = {"max_batch": 4, "gpu_memory": 1 << 30}
    info, phased = _run(pipe, settings, tmp_path, "phased", rows, phases="on", **common)
    assert info["phases"]["chunks"] == 1
    assert info["phases"]["prompts_encoded"] == 4  # not 32
    assert info["phases"]["encode_calls"] == 4 and info["phases"]["calls_reused"] == 4  # 8 batches of 4
    _, per_batch = _run(pipe, settings, tmp_path, "per-batch", rows, phases="off", **common)
    assert phased.keys() == per_batch.keys() and len(phased) == 32

    def pixels(data: bytes):
        import io

        return np.asarray(Image.open(io.BytesIO(data)), dtype=np.int16)

    assert max(np.abs(pixels(phased[i]) - pixels(per_batch[i])).max() for i in phased) <= 2


@pytest.mark.slow
def test_an_oom_mid_chunk_rebatches_and_encodes_the_rest_again(tmp_path):
    """An out-of-memory error in phase 2 halves the batch; the chunk's remaining images are re-batched
    at the new size and encoded again in phase 1, never run with another batch's embeddings."""
    pipe, settings = _pipeline("flux"), _settings("flux")
    rows = [f"a harbour, number {i}" for i in range(8)]
    fired = []

    def oom_once(module, args, kwargs):
        if not fired and kwargs.get("hidden_states", args[0] if args else None).shape[0] == 4:
            fired.append(1)
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    hook = pipe.transformer.register_forward_pre_hook(oom_once, with_kwargs=True)
    try:
        info, phased = _run(pipe, settings, tmp_path, "phased", rows, phases="on", max_batch=4, gpu_memory=1 << 30)
    finally:
        hook.remove()
    assert fired and info["batch_size"] == 2 and info["step_downs"][0]["to"] == "batch 2"
    # the failed batch of 4 ran again as two batches of 2, each encoded in phase 2; the second chunk's
    # batches (of 2) were encoded in phase 1 again
    assert info["phases"]["encoded_again"] == 2 and info["phases"]["chunks"] == 2
    _, per_batch = _run(pipe, settings, tmp_path, "per-batch", rows, phases="off", max_batch=2, gpu_memory=1 << 30)
    assert phased == per_batch  # after the step-down: batches of 2, the same as a run at batch 2


FIVE = {"flux", "flux2-klein", "qwen-image", "z-image-turbo", "wan"}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(DECODE_APART - FIVE) + ["sd"])
def test_every_family_that_decodes_apart_makes_the_per_batch_images(family, tmp_path):
    """The rest of the families the table lets decode in a phase of their own, phased against per
    batch; SD decodes beside its UNet (its safety checker reads the decoded images) and says so."""
    pipe, settings = TINY_FAMILIES[family](0), _settings(family)
    rows = [f"a lighthouse at dusk, number {i % 3}" for i in range(5)]
    common = {"max_batch": 2, "gpu_memory": 1 << 30}
    phased, phased_images = _run(pipe, settings, tmp_path, "phased", rows, phases="on", **common)
    _, per_batch = _run(pipe, settings, tmp_path, "per-batch", rows, phases="off", **common)
    assert phased_images == per_batch and len(per_batch) >= 5
    apart = family in DECODE_APART
    assert (phased["plan"]["phases"][-1] == ["vae"]) is apart
    assert ("the VAE decoding in phase 2" in phased["plan"]["reason"]) is not apart


@pytest.mark.slow
def test_a_decode_that_runs_out_of_memory_is_decoded_an_image_at_a_time(tmp_path):
    """Phase 3 decodes a batch; an OOM there (injected in the VAE's decoder at batch 2) decodes each of
    its images alone: every image stored, as per batch within rounding; none lost."""
    import io

    import numpy as np
    from PIL import Image

    pipe, settings = _pipeline("flux"), _settings("flux")
    rows = [f"a quay at night, number {i}" for i in range(4)]

    def oom_at_two(module, args):
        if args[0].shape[0] > 1:
            raise torch.OutOfMemoryError("CUDA out of memory (injected in the decode)")

    hook = pipe.vae.decoder.register_forward_pre_hook(oom_at_two)
    try:
        info, phased = _run(pipe, settings, tmp_path, "phased", rows, phases="on", max_batch=2, gpu_memory=1 << 30)
    finally:
        hook.remove()
    assert info["plan"]["phases"][-1] == ["vae"] and len(phased) == 4
    _, per_batch = _run(pipe, settings, tmp_path, "per-batch", rows, phases="off", max_batch=2, gpu_memory=1 << 30)

    def pixels(data: bytes):
        return np.asarray(Image.open(io.BytesIO(data)), dtype=np.int16)

    assert phased.keys() == per_batch.keys()
    assert max(np.abs(pixels(phased[k]) - pixels(per_batch[k])).max() for k in phased) <= 2

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
from tests.conftest import FAST, png, write_prompts

# bytes given to the tiny text encoder and denoiser (as the 2026 models' are, both large beside the rest),
# so that where they live matters to the plan
BALLAST = {"text_encoder": 64 << 20, "transformer": 48 << 20}
# a clip's frames stored as PNG too: they are what phasing must keep (its H.264 bytes are compared by
# frames: x264 has been seen to encode the same frames differently once in a while on the writer thread)
VIDEO = {"task": "text-to-video", "num_frames": 5, "height": 48, "fps": 16.0, "store_frames": True}


def _settings(family: str, **over) -> GenerationSettings:
    video = VIDEO if family.startswith("wan") or family.startswith("hunyuanvideo") else {}
    # 64x64: FLUX.2 takes no input image under 64 px (the tests' FAST size is 32)
    base = {**{k: FAST[k] for k in ("steps", "guidance")}, "width": 64, "height": 64}
    return GenerationSettings(
        **{"task": "text-to-image", "family": family, "output_format": "files", **base, **video, **over}
    )


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


def _run(pipe, settings, tmp_path, name, rows: list[str], inputs: dict | None = None, device="cpu", hook=None, **spec):
    """`inputs`: columns of input pictures (`input_image`, `mask_image`) beside the prompts; `hook`: called
    with the worker once its shards are made."""
    path = tmp_path / "prompts.parquet"
    if not path.exists():
        write_prompts(path, rows, id=[f"r{i}" for i in range(len(rows))], **(inputs or {}))
    files = [read_footer(str(path))]
    columns = Columns.of(
        image="input_image" if inputs else None, mask="mask_image" if "mask_image" in (inputs or {}) else None
    )
    out = tmp_path / name
    worker = Worker(
        WorkerSpec.of(
            "w0", "tiny", str(out), settings, resolve_columns(files, columns), device=device, threads=1, **spec
        ),
        pipe,
    )
    try:
        for shard in plan_shards(files, 100):
            worker.run_shard(shard)
        info = worker.describe()
        if hook is not None:
            hook(worker)
    finally:
        worker.close()
    manifest = pq.read_table(out / "shards").to_pylist()
    assert [r["error"] for r in manifest if r["status"] != "ok"] == []
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


def test_the_scorers_are_a_phase_of_their_own_after_the_decode(tiny_clip, tmp_path):
    """Phased with a decode phase, the scorers move onto the device once per chunk, after the VAE has left
    it, and off again before the next chunk's encoders; per batch they stay. The scores are the same."""
    from fleetgen.scores import parse_scores

    pipe = _pipeline("flux")
    settings = _settings("flux", score=parse_scores(f"clip={tiny_clip}"))
    budget = _budget(pipe, settings, max_batch=2)
    rows = [f"a lighthouse at dusk, number {i}" for i in range(5)]
    seen = {}

    def state(worker):
        seen[worker.fitted.phases is not None] = (worker.scoring.on_device, worker.fitted.phases)

    common = {"max_batch": 2, "gpu_memory": budget, "hook": state}
    phased, _ = _run(pipe, settings, tmp_path, "phased", rows, phases="on", **common)
    per_batch, _ = _run(pipe, settings, tmp_path, "per-batch", rows, phases="off", **common)
    assert phased["plan"]["phases"][-1] == ["vae"]
    assert (
        "then the scorers" in phased["plan"]["reason"]
        and "alone on the device score the chunk" in phased["plan"]["reason"]
    )
    assert phased["scoring"]["moved_on"] == phased["phases"]["chunks"] >= 1 and phased["scoring"]["images"] == 5
    on_device, phases = seen[True]
    assert not on_device and phases.current is None  # released after the chunk; the VAE moved off before them
    assert per_batch["scoring"]["moved_on"] == 1 and seen[False][0]  # resident from the first score on
    scores = {
        run: {r["id"]: r["score_clip"] for r in pq.read_table(tmp_path / run / "shards").to_pylist()}
        for run in ("phased", "per-batch")
    }
    assert scores["phased"] == pytest.approx(scores["per-batch"], abs=1e-6) and len(scores["phased"]) == 5


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


IMAGE_TASKS = [
    ("flux", "image-to-image"),
    *(
        pytest.param(family, task, marks=pytest.mark.slow)
        for family, task in [
            ("flux", "inpaint"),
            ("flux-kontext", "edit"),
            ("flux2-klein", "edit"),
            ("qwen-image", "image-to-image"),
            ("sd", "inpaint"),
            ("sdxl", "image-to-image"),
            ("wan-i2v", "image-to-video"),
            ("wan2.1-i2v", "image-to-video"),  # with its CLIP image encoder: `encode_image` in phase 1
            ("ltx-video", "image-to-video"),
        ]
    ),
]


@pytest.mark.parametrize(("family", "task"), IMAGE_TASKS)
def test_tasks_that_take_images_are_phased_and_make_the_per_batch_images(family, task, tmp_path):
    """Each row's input picture (and mask) loaded for the whole chunk before phase 1; the prompts
    encoded in phase 1, the VAE encoding the inputs beside the denoiser in phase 2 (where it decodes
    too): the per-batch images, byte for byte."""
    if family == "wan2.1-i2v":
        from fleetgen.workers.tiny.video import build_tiny_wan_i2v

        family, pipe = "wan-i2v", build_tiny_wan_i2v(0, image_encoder=True)
    else:
        pipe = TINY_FAMILIES[family](0)
    ltx = family == "ltx-video"  # frames 8k+1, sides multiples of 32
    video = {"num_frames": 9 if ltx else 5, "height": 64 if ltx else 48, "fps": 16.0, "store_frames": True}
    # at least one step: SDXL's default strength (0.3) of 2 steps denoises none
    settings = _settings(
        family,
        task=task,
        strength=0.6 if task != "edit" and "video" not in task else None,
        **(video if "video" in task else {}),
    )
    colors = ["red", "green", "blue", "yellow", "red"]  # two rows share a picture
    size = (settings.width, settings.height)
    inputs = {"input_image": [png(c, size) for c in colors]}
    if task == "inpaint":
        inputs["mask_image"] = [png(c, size) for c in ("white", "black", "white", "white", "black")]
    rows = [f"a lighthouse at dusk, number {i % 2}" for i in range(5)]
    common = {"max_batch": 2, "gpu_memory": 1 << 30, "inputs": inputs}
    seen = []  # the image encoder's runs (Wan 2.1): once per picture in phase 1, none in phase 2
    encoder = getattr(pipe, "image_encoder", None)
    hook = encoder.register_forward_pre_hook(lambda *_: seen.append(1)) if encoder is not None else None
    phased, phased_images = _run(pipe, settings, tmp_path, "phased", rows, phases="on", **common)
    if hook is not None:
        hook.remove()
        assert len(seen) == 4  # 4 pictures, one of them in two rows: phase 2 ran it for none
    _, per_batch = _run(pipe, settings, tmp_path, "per-batch", rows, phases="off", **common)
    assert phased["phases"]["chunks"] == 1 and phased["phases"]["encoded_again"] == 0
    assert phased["offload"]["components"]["text_encoder"]["swaps"] == 1  # once for the chunk
    if hasattr(pipe, "image_encoder") and pipe.image_encoder is not None:
        assert "image_encoder" in phased["plan"]["phases"][0] and phased["phases"]["encode_calls"] == 2 + 4
    assert "vae" in phased["plan"]["phases"][1] and len(phased["plan"]["phases"]) == 2
    assert "the VAE encoding the input images and decoding in phase 2" in phased["plan"]["reason"]
    assert phased_images == per_batch and len(per_batch) >= 5
    # rows batched as the task allows (LTX's image-to-video takes a batch of first frames), never
    # retried one by one after a failed call
    batched = settings.task_spec().batched
    for name in ("phased", "per-batch"):
        sizes = sorted(r["batch"] for r in pq.read_table(tmp_path / name / "shards").to_pylist())
        assert sizes == ([1, 2, 2, 2, 2] if batched else [1] * 5)


def test_an_encoder_call_is_known_by_its_pictures_values_not_only_their_shape():
    """Two calls with the same prompt and other input pictures (an edit model's vision-language
    encoder reads them) are two calls; the same values are one."""
    from PIL import Image

    from fleetgen.workers.pipeline.phases import call_key, runs

    red, blue = Image.new("RGB", (8, 8), "red"), Image.new("RGB", (8, 8), "blue")
    assert call_key({"prompt": "x", "image": red}) != call_key({"prompt": "x", "image": blue})
    assert call_key({"prompt": "x", "image": red}) == call_key({"prompt": "x", "image": red.copy()})
    a, b = torch.zeros(2, 3), torch.zeros(2, 3)
    b[1, 2] = 1
    assert call_key((a,)) != call_key((b,)) and call_key((a,)) == call_key((a.clone(),))
    # equal runs of prompts are encoded once each, unless the call reads pictures too
    text = {"prompt": ["a", "a", "b", "b"], "num_images_per_prompt": 1}
    assert runs(text) == ({"prompt": ["a", "b"], "num_images_per_prompt": 2}, 2)
    assert runs({**text, "image": [red, red, blue, blue]}) is None


@pytest.mark.gpu
def test_a_phased_image_to_image_on_cuda_makes_the_per_batch_images(tmp_path):
    """The CUDA path (`make gpu-check`): FLUX.1 image-to-image phased on the device — the chunk's input
    pictures read before phase 1, the text encoder resident in phase 1 and off the device in phase 2, the
    VAE encoding the inputs beside the transformer — against per batch at the same batches."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    import io

    import numpy as np
    from PIL import Image

    pipe, settings = _pipeline("flux"), _settings("flux", task="image-to-image", strength=0.6)
    inputs = {"input_image": [png(c, (64, 64)) for c in ("red", "green", "blue", "red")]}
    rows = [f"a lighthouse at dusk, number {i % 2}" for i in range(4)]
    common = {"max_batch": 2, "gpu_memory": 1 << 30, "inputs": inputs, "device": "cuda"}
    phased, phased_images = _run(pipe, settings, tmp_path, "phased", rows, phases="on", **common)
    _, per_batch = _run(pipe, settings, tmp_path, "per-batch", rows, phases="off", **common)
    assert phased["phases"]["chunks"] == 1 and phased["offload"]["components"]["text_encoder"]["swaps"] == 1
    assert len(phased["phases"]["peak_device_bytes"]) == 2  # measured per phase on CUDA

    def pixels(data: bytes):
        return np.asarray(Image.open(io.BytesIO(data)), dtype=np.int16)

    assert phased_images.keys() == per_batch.keys() and len(per_batch) == 4
    assert max(np.abs(pixels(phased_images[k]) - pixels(per_batch[k])).max() for k in per_batch) <= 2


@pytest.mark.gpu
def test_on_cuda_the_scorers_phase_leaves_the_device_to_the_next_chunk(tiny_clip, tmp_path):
    """The CUDA path (`make gpu-check`): phased FLUX.1 with a CLIP scorer on the device — after the run
    the scorer's weights and every phase's components are off the device (released after the decode
    phase), and the scores are the per-batch run's within bfloat16 rounding."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from fleetgen.scores import parse_scores

    pipe = _pipeline("flux")
    settings = _settings("flux", score=parse_scores(f"clip={tiny_clip}"))
    seen = {}

    def state(worker):
        scorer = worker.scoring.modules[0]
        seen[worker.fitted.phases is not None] = (next(scorer.parameters()).device.type, worker.scoring.on_device)

    common = {"max_batch": 2, "gpu_memory": 1 << 30, "device": "cuda", "hook": state}
    rows = [f"a lighthouse at dusk, number {i}" for i in range(4)]
    phased, _ = _run(pipe, settings, tmp_path, "phased", rows, phases="on", **common)
    per_batch, _ = _run(pipe, settings, tmp_path, "per-batch", rows, phases="off", **common)
    assert phased["plan"]["phases"][-1] == ["vae"] and phased["scoring"]["moved_on"] == phased["phases"]["chunks"]
    assert seen[True] == ("cpu", False) and seen[False] == ("cuda", True)
    scores = {
        run: {r["id"]: r["score_clip"] for r in pq.read_table(tmp_path / run / "shards").to_pylist()}
        for run in ("phased", "per-batch")
    }
    assert scores["phased"] == pytest.approx(scores["per-batch"], abs=0.02)

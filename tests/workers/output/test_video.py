"""Video: tiny Wan text-to-video, Wan 2.2's two experts, Wan image-to-video, LTX-Video (text- and
image-to-video from one checkpoint), LTX-2 (clips with their sound) and HunyuanVideo 1.5 (guided by its guider) through a worker (no Ray), every clip decoded with PyAV; the three output formats read back by `webdataset` and
`datasets`; per-row `num_frames` and `fps`; frame-count rules; `verify --deep` over clips."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from fleetgen.jobs.sharding import plan_shards, read_footer, resolve_columns
from fleetgen.jobs.verify import verify
from fleetgen.workers.output.video import Clip, encode_clip, first_frame, read_clip
from fleetgen.workers.rows.shard import Columns
from fleetgen.workers.spec import GenerationSettings, WorkerSpec
from fleetgen.workers.tiny import write_tiny_model
from fleetgen.workers.worker import Worker

FAST = {"steps": 2, "guidance": 5.0, "width": 64, "height": 48, "num_frames": 5, "fps": 16.0}


@pytest.fixture(scope="module")
def wan(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("video")
    families = ("wan", "wan2.2", "wan-i2v", "ltx-video", "ltx-2", "hunyuanvideo-1.5")
    return {f: str(write_tiny_model(root / f, family=f)) for f in families}


def png(color, size=(80, 60)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return buf.getvalue()


def run(model, tmp_path, rows: dict, family="wan", task="text-to-video", name="out", **settings):
    """One shard of `rows` through a worker in this process; returns (manifest rows by id, output)."""
    path = tmp_path / f"{name}.parquet"
    pq.write_table(pa.table(rows), path)
    files = [read_footer(str(path))]
    roles = {k: k for k in ("num_frames", "fps") if k in rows}
    columns = resolve_columns(files, Columns.of(image="input_image" if "input_image" in rows else None, **roles))
    s = GenerationSettings(task=task, family=family, **{**FAST, "output_format": "files", **settings})
    out = tmp_path / name
    worker = Worker(WorkerSpec.of("w0", str(model), str(out), s, columns, max_batch=4, device="cpu", threads=1))
    try:
        worker.run_shard(plan_shards(files, 100)[0])
    finally:
        worker.close()
    # verify reads the job record for the output format
    job = {"fingerprint": {"generation": {"output_format": s.output_format}}}
    (out / "job.json").write_text(json.dumps(job))
    return {r["id"]: r for r in pq.read_table(out / "shards" / "shard-00000.parquet").to_pylist()}, out


def run_offloaded(model, tmp_path, rows, offload):
    path = tmp_path / "o.parquet"
    pq.write_table(pa.table(rows), path)
    files = [read_footer(str(path))]
    s = GenerationSettings(
        task="text-to-video", family="wan2.2", store_frames=True, **{**FAST, "output_format": "files"}
    )
    out = tmp_path / offload
    spec = WorkerSpec.of("w0", str(model), str(out), s, resolve_columns(files, Columns()), max_batch=4, device="cpu")
    worker = Worker(spec.with_options(threads=1, offload=offload, gpu_memory=1 << 30))
    try:
        assert set(worker.plan.to_dict()["modes"].values()) != {"resident"}
        worker.run_shard(plan_shards(files, 100)[0])
    finally:
        worker.close()
    return {r["id"]: r for r in pq.read_table(out / "shards" / "shard-00000.parquet").to_pylist()}, out


def frame_pngs(out) -> dict[str, bytes]:
    """Every stored frame (`--store-frames`), by its key: what the pipeline made, byte for byte (a clip's
    H.264 bytes are not: x264 has been seen to encode the same frames differently once in a while)."""
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted((out / "images").rglob("*.png"))}


def rms(path) -> float:
    import av

    with av.open(str(path)) as f:
        samples = np.concatenate([frame.to_ndarray().ravel() for frame in f.decode(audio=0)])
    return float(np.sqrt(np.mean(samples.astype(np.float64) ** 2)))


def video_frames(data: bytes) -> list:
    import av

    with av.open(io.BytesIO(data)) as f:
        return [frame.to_image() for frame in f.decode(video=0)]


def test_text_to_video_clips_decode_with_the_frames_fps_and_size_asked(wan, tmp_path):
    rows = {
        "id": ["a", "b", "c", "d"],
        "prompt": ["a cat", "a dog", "a fox", "a owl"],
        "num_frames": [9, None, 10, None],  # 10 is not 4k+1: Wan would round it silently
        "fps": [None, 8.0, None, 24.0],
    }
    manifest, out = run(wan["wan"], tmp_path, rows)
    assert manifest["c"]["status"] == "error" and "4k+1" in manifest["c"]["error"]
    expected = {"a": (9, 16.0), "b": (5, 8.0), "d": (5, 24.0)}
    for rid, (frames, fps) in expected.items():
        r = manifest[rid]
        data = (out / r["image"]).read_bytes()
        assert r["image"] == f"images/shard-00000/{rid}.mp4" and r["status"] == "ok"
        assert (r["num_frames"], r["fps"], r["codec"]) == (frames, fps, "h264")
        assert r["duration"] == pytest.approx(frames / fps, abs=1e-3)
        assert r["sha256"] == hashlib.sha256(data).hexdigest() and r["size"] == len(data)
        clip = read_clip(data)
        assert (clip.frames, clip.fps, clip.width, clip.height, clip.codec) == (frames, fps, 64, 48, "h264")
        poster = Image.open(out / f"images/shard-00000/{rid}.poster.jpg")
        assert poster.size == (64, 48)
        # the poster is the clip's first frame (both lossy: close, not equal)
        diff = np.abs(np.asarray(poster, np.int16) - np.asarray(first_frame(data), np.int16)).mean()
        assert diff < 8
    report = verify(str(out), deep=True)
    assert report.clean and report.hashed == 3


def test_verify_deep_decodes_every_frame_of_a_clip(wan, tmp_path):
    manifest, out = run(wan["wan"], tmp_path, {"id": ["a"], "prompt": ["a cat"]})
    # a manifest whose digest matches but whose frame count does not: only decoding finds it
    path = out / "shards" / "shard-00000.parquet"
    table = pq.read_table(path)
    i = table.schema.get_field_index("num_frames")
    pq.write_table(table.set_column(i, table.schema.field(i), pa.array([9], pa.int32())), path)
    assert verify(str(out)).clean  # the bytes are the ones recorded
    report = verify(str(out), deep=True)
    assert not report.clean and "5 frames decode; the manifest says 9" in json.dumps(report.to_dict())


@pytest.mark.parametrize("output_format", ["webdataset", "parquet"])
def test_clips_in_tars_and_parquet_read_back_with_webdataset_and_datasets(output_format, wan, tmp_path):
    rows = {"id": ["a", "b"], "prompt": ["a cat", "a dog"], "num_frames": [9, 5]}
    manifest, out = run(wan["wan"], tmp_path, rows, output_format=output_format, video_format="mp4")
    assert verify(str(out), deep=True).clean
    if output_format == "webdataset":
        import webdataset as wds

        samples = {s["__key__"]: s for s in wds.WebDataset(str(out / "data" / "shard-00000.tar"), shardshuffle=False)}
        clips = {k: s["mp4"] for k, s in samples.items()}
        assert {k: json.loads(s["json"])["num_frames"] for k, s in samples.items()} == {"a": 9, "b": 5}
        assert all(Image.open(io.BytesIO(s["poster.jpg"])).size == (64, 48) for s in samples.values())
        with tarfile.open(out / "data" / "shard-00000.tar") as tar:
            assert sorted(tar.getnames()) == sorted(f"{k}.{e}" for k in "ab" for e in ("mp4", "poster.jpg", "json"))
    else:
        import datasets

        ds = datasets.load_dataset(str(out), data_files="data/*.parquet", split="train")
        assert isinstance(ds.features["video"], datasets.Video) and isinstance(ds.features["poster"], datasets.Image)
        ds = ds.cast_column("video", datasets.Video(decode=False))
        clips = {r["id"]: r["video"]["bytes"] for r in ds}
        assert {r["id"]: r["poster"].size for r in ds} == {"a": (64, 48), "b": (64, 48)}
    assert {k: read_clip(v).frames for k, v in clips.items()} == {"a": 9, "b": 5}
    assert {k: hashlib.sha256(v).hexdigest() for k, v in clips.items()} == {k: manifest[k]["sha256"] for k in "ab"}


def test_wan22_two_experts_and_webm(wan, tmp_path):
    manifest, out = run(
        wan["wan2.2"], tmp_path, {"id": ["a"], "prompt": ["a cat"]}, family="wan2.2", video_format="webm"
    )
    r = manifest["a"]
    assert r["status"] == "ok" and r["image"].endswith(".webm") and r["codec"] == "av1"
    clip = read_clip((out / r["image"]).read_bytes())
    assert (clip.frames, clip.codec, clip.width, clip.height) == (5, "av1", 64, 48)


def test_image_to_video_starts_from_the_rows_image(wan, tmp_path):
    rows = {"id": ["a", "b"], "prompt": ["a cat", "a dog"], "input_image": [png((200, 30, 30)), None]}
    manifest, out = run(wan["wan-i2v"], tmp_path, rows, family="wan-i2v", task="image-to-video")
    a, b = manifest["a"], manifest["b"]
    assert a["status"] == "ok" and a["batch"] == 1  # one row per call: the pipeline takes one image
    assert [x["role"] for x in a["inputs"]] == ["image"] and a["inputs"][0]["sha256"] == hashlib.sha256(
        png((200, 30, 30))
    ).hexdigest()
    assert read_clip((out / a["image"]).read_bytes()).frames == 5
    assert b["status"] == "error" and "no input image" in b["error"]


def test_a_clip_is_the_same_bytes_when_made_again(wan, tmp_path):
    rows = {"id": ["a"], "prompt": ["a cat"]}
    first, _ = run(wan["wan"], tmp_path, rows, name="one")
    second, _ = run(wan["wan"], tmp_path, rows, name="two")
    assert first["a"]["sha256"] == second["a"]["sha256"]  # a retried clip replaces its bytes with the same bytes


def test_encoding_is_deterministic_and_reads_back_fractional_rates():
    frames = [Image.new("RGB", (32, 16), (i * 20, 80, 40)) for i in range(7)]
    for fmt, codec in (("mp4", "h264"), ("webm", "av1")):
        data, info = encode_clip(Clip(frames, 23.976), fmt, 30)
        assert data == encode_clip(Clip(frames, 23.976), fmt, 30)[0]
        clip = read_clip(data)
        assert (clip.frames, clip.codec, info["codec"]) == (7, codec, codec)
        assert clip.fps == pytest.approx(23.976, abs=1e-3)
    with pytest.raises(ValueError, match="not a readable clip"):
        read_clip(b"not a clip")
    # with sound: the same bytes again, mono or stereo, at the model's rate (Opus: 48 kHz)
    tone = np.sin(np.arange(4410) / 22050 * 2 * np.pi * 440).astype(np.float32)[None] * 0.5
    for fmt, rate in (("mp4", 22050), ("webm", 48000)):
        for track in (tone, np.concatenate([tone, -tone])):
            data, info = encode_clip(Clip(frames, 23.976, track, 22050), fmt, 30)
            assert data == encode_clip(Clip(frames, 23.976, track, 22050), fmt, 30)[0]
            clip = read_clip(data)
            assert (clip.frames, clip.sample_rate, info["sample_rate"]) == (7, rate, rate)
    with pytest.raises(ValueError, match="3 channels"):
        encode_clip(Clip(frames, 24.0, np.zeros((3, 100), np.float32), 22050), "mp4", 30)


@pytest.mark.parametrize("offload", ["block", "leaf"])
def test_group_offloading_keeps_the_clips_bytes(offload, wan, tmp_path):
    rows = {"id": ["a", "b"], "prompt": ["a cat", "a dog"]}
    resident, at = run(wan["wan2.2"], tmp_path, rows, family="wan2.2", name="resident", store_frames=True)
    offloaded, out = run_offloaded(wan["wan2.2"], tmp_path, rows, offload)
    # the batches, then every frame's pixels: the same calls made the same clips
    assert {k: r["batch"] for k, r in offloaded.items()} == {k: r["batch"] for k, r in resident.items()}
    frames = frame_pngs(at)
    assert frame_pngs(out) == frames and len(frames) == 2 * FAST["num_frames"]


def test_ltx_makes_clips_from_text_and_from_images_with_its_frame_rate(wan, tmp_path):
    rows = {"id": ["a", "b"], "prompt": ["a cat", "a dog"], "fps": [None, 12.0]}
    settings = {"family": "ltx-video", "num_frames": 9, "fps": 25.0, "width": 64, "height": 64}
    manifest, out = run(wan["ltx-video"], tmp_path, rows, name="t2v", **settings)
    for rid, fps in (("a", 25.0), ("b", 12.0)):
        clip = read_clip((out / manifest[rid]["image"]).read_bytes())
        assert (clip.frames, clip.fps, manifest[rid]["fps"]) == (9, fps, fps)
    rows = {**rows, "input_image": [png((200, 30, 30)), png((30, 30, 200))], "num_frames": [9, 12]}
    manifest, out = run(wan["ltx-video"], tmp_path, rows, task="image-to-video", name="i2v", **settings)
    assert manifest["a"]["status"] == "ok" and manifest["a"]["inputs"][0]["role"] == "image"
    assert "not 8k+1" in manifest["b"]["error"]  # LTX makes 8k+1 frames: 12 would be rounded
    # the clip's rate is the pipeline's `frame_rate` (LTX conditions on it), from the row's fps
    from fleetgen.workers.pipeline.fitted import FittedPipeline
    from fleetgen.workers.rows.batches import Look
    from fleetgen.workers.spec import Source

    job = GenerationSettings(family="ltx-video", task="text-to-video", steps=2, guidance=3.0, width=64, height=64)
    fitted = FittedPipeline(Source(wan["ltx-video"], "cpu"), job)
    look = Look(64, 64, 2, 3.0, extra=(("num_frames", 9), ("fps", 12.0)))
    kwargs = fitted.calls.kwargs(["a cat"], [None], look, None)
    assert (kwargs["frame_rate"], kwargs["num_frames"], kwargs["max_sequence_length"]) == (12.0, 9, 128)
    fitted.close()


def test_a_clip_that_runs_out_of_memory_steps_down_never_to_fewer_frames(wan, tmp_path):
    """An OOM (a real torch.OutOfMemoryError, injected while the transformer is resident) halves the
    batch, then leans the plan; every clip still has the frames asked."""
    import torch

    from fleetgen.offload.stats import find_groups

    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "prompt": ["a cat", "a dog"], "num_frames": [9, 9]}), path)
    files = [read_footer(str(path))]
    s = GenerationSettings(task="text-to-video", family="wan", **{**FAST, "output_format": "files"})
    columns = resolve_columns(files, Columns.of(num_frames="num_frames"))
    out = tmp_path / "out"
    spec = WorkerSpec.of(
        "w0", wan["wan"], str(out), s, columns, max_batch=2, device="cpu", threads=1, gpu_memory=1 << 30
    )
    worker = Worker(spec)
    assert worker.batch_size == 2 and set(worker.plan.modes.values()) == {"resident"}

    def fail_while_resident(module, args):
        if not find_groups(module):
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    worker.pipe.transformer.register_forward_pre_hook(fail_while_resident)
    try:
        result = worker.run_shard(plan_shards(files, 100)[0])
    finally:
        worker.close()
    assert result.ok == 2 and worker.step_downs[0]["to"] == "batch 1"
    assert worker.plan.modes["transformer"] != "resident"
    manifest = {r["id"]: r for r in pq.read_table(out / "shards" / "shard-00000.parquet").to_pylist()}
    assert {k: read_clip((out / r["image"]).read_bytes()).frames for k, r in manifest.items()} == {"a": 9, "b": 9}


def test_hunyuanvideo15_is_guided_through_its_guider(wan, tmp_path):
    rows = {"id": ["a", "b"], "prompt": ["a cat", "a dog"]}
    settings = {"family": "hunyuanvideo-1.5", "guidance": 3.0, "width": 32, "height": 32, "num_frames": 9}
    manifest, out = run(wan["hunyuanvideo-1.5"], tmp_path, rows, **settings)
    assert {k: read_clip((out / r["image"]).read_bytes()).frames for k, r in manifest.items()} == {"a": 9, "b": 9}
    assert {r["guidance"] for r in manifest.values()} == {3.0}
    from fleetgen.workers.pipeline.fitted import FittedPipeline
    from fleetgen.workers.rows.batches import Look
    from fleetgen.workers.spec import Source

    job = GenerationSettings(
        family="hunyuanvideo-1.5", task="text-to-video", steps=2, guidance=6.0, width=32, height=32
    )
    fitted = FittedPipeline(Source(wan["hunyuanvideo-1.5"], "cpu"), job)
    assert fitted.pipe.guider.guidance_scale == 6.0  # as saved
    fitted.calls.kwargs(["a cat"], [None], Look(32, 32, 2, 3.0, extra=(("num_frames", 9),)), None)
    assert fitted.pipe.guider.guidance_scale == 3.0  # the job's, set on the guider before the call
    fitted.close()


@pytest.mark.slow  # the S3 server and two shards of retries: seconds
@pytest.mark.parametrize("output_format", ["files", "webdataset"])
def test_clips_to_a_flaky_s3_store_are_whole_or_not_committed(output_format, wan, faulty_store, tmp_path):
    """Clips and posters to `s3://` through the fault-injecting proxy (5 % of requests faulted):
    what commits is every clip, its poster and its digest; `verify --deep` over S3 finds it whole."""
    import s3fs

    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": faulty_store.endpoint}, key="k", secret="s")
    bucket = f"clips-{output_format}"
    fs.mkdirs(bucket, exist_ok=True)
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(4)], "prompt": ["a red fox"] * 4}), path)
    files = [read_footer(str(path))]
    s = GenerationSettings(task="text-to-video", family="wan", **{**FAST, "output_format": output_format})
    out = f"s3://{bucket}/out"
    spec = WorkerSpec.of(
        "w0", wan["wan"], out, s, resolve_columns(files, Columns()), max_batch=2, device="cpu", threads=1
    )
    worker = Worker(spec)
    worker.output.put(
        "job.json", json.dumps({"fingerprint": {"generation": {"output_format": output_format}}}).encode()
    )
    faulty_store.reset(rate=0.05, seed=3)
    try:
        for shard in plan_shards(files, 2):
            for attempt in range(4):  # a shard whose store failed is retried, as the driver would
                try:
                    worker.run_shard(shard)
                    break
                except Exception:  # noqa: BLE001 - the store's fault; the next attempt redoes the shard
                    assert attempt < 3
    finally:
        faults = faulty_store.faulted()
        faulty_store.reset()
        worker.close()
    assert faults > 0  # the faults did happen
    report = verify(out, deep=True)
    assert report.clean and report.images == 4, report.to_dict()
    if output_format == "files":
        keys = {k.rsplit("/", 1)[-1] for k in fs.find(f"{bucket}/out/images")}
        assert keys == {f"r{i}.{e}" for i in range(4) for e in ("mp4", "poster.jpg")}


def test_ltx2_clips_carry_their_sound_and_verify_deep_checks_it(wan, tmp_path):
    """LTX-2's vocoder output is the clip's audio stream (AAC in mp4, Opus in webm), as long as its
    frames; the record says codec and rate; `verify --deep` decodes it and finds one gone."""
    rows = {"id": ["a", "b"], "prompt": ["a cat", "a dog"], "fps": [None, 12.0]}
    settings = {"family": "ltx-2", "num_frames": 9, "fps": 25.0, "width": 64, "height": 32}
    manifest, out = run(wan["ltx-2"], tmp_path, rows, name="t2v", **settings)
    for rid, fps in (("a", 25.0), ("b", 12.0)):
        r = manifest[rid]
        clip = read_clip((out / r["image"]).read_bytes())
        assert (clip.frames, clip.fps, clip.width, clip.height) == (9, fps, 64, 32)
        assert (clip.audio_codec, clip.sample_rate, r["audio_codec"], r["sample_rate"]) == ("aac", 16000, "aac", 16000)
        # the sound lasts as long as the frames (AAC pads to its 1024-sample frames)
        assert 9 / fps - 0.05 < clip.audio_samples / 16000 < 9 / fps + 2048 / 16000
        assert rms(out / r["image"]) > 0  # not a silent track
    assert verify(str(out), deep=True).clean
    path = out / "shards" / "shard-00000.parquet"
    table = pq.read_table(path)
    i = table.schema.get_field_index("audio_codec")
    pq.write_table(table.set_column(i, table.schema.field(i), pa.array([None, None], pa.string())), path)
    report = verify(str(out), deep=True)
    assert not report.clean and "its sound is aac; the manifest says none" in json.dumps(report.to_dict())
    # image-to-video from the same weights, one row per call, in webm: Opus at 48 kHz
    rows = {"id": ["a"], "prompt": ["a cat"], "input_image": [png((200, 30, 30))]}
    manifest, out = run(
        wan["ltx-2"], tmp_path, rows, task="image-to-video", name="i2v", video_format="webm", **settings
    )
    r = manifest["a"]
    assert (r["status"], r["batch"], r["audio_codec"], r["sample_rate"]) == ("ok", 1, "opus", 48000)
    clip = read_clip((out / r["image"]).read_bytes())
    assert (clip.frames, clip.codec, clip.audio_codec) == (9, "av1", "opus")
    assert verify(str(out), deep=True).clean


@pytest.mark.parametrize("output_format", ["files", "webdataset", "parquet"])
def test_store_frames_keeps_every_frame_as_made_beside_its_clip(output_format, wan, tmp_path):
    """`--store-frames`: each frame a lossless PNG beside the clip (files, webdataset members, a parquet
    `frames` list of images); the staged commit keeps them with their clip; verify finds no orphan."""
    rows = {"id": ["a", "b"], "prompt": ["a cat", "a dog"], "num_frames": [9, 5]}
    manifest, out = run(wan["wan"], tmp_path, rows, output_format=output_format, store_frames=True, crf=0)
    frames, clips = {}, {}
    if output_format == "files":
        for rid in "ab":
            keys = sorted((out / "images" / "shard-00000").glob(f"{rid}.frame-*.png"))
            frames[rid] = [Image.open(k).convert("RGB") for k in keys]
            clips[rid] = (out / manifest[rid]["image"]).read_bytes()
    elif output_format == "webdataset":
        import webdataset as wds

        for s in wds.WebDataset(str(out / "data" / "shard-00000.tar"), shardshuffle=False):
            names = sorted(k for k in s if k.startswith("frame-"))
            frames[s["__key__"]] = [Image.open(io.BytesIO(s[k])).convert("RGB") for k in names]
            clips[s["__key__"]] = s["mp4"]
    else:
        import datasets

        ds = datasets.load_dataset(str(out), data_files="data/*.parquet", split="train")
        assert isinstance(ds.features["frames"], (datasets.Sequence, getattr(datasets, "List", datasets.Sequence)))
        ds = ds.cast_column("video", datasets.Video(decode=False))
        frames = {r["id"]: [f.convert("RGB") for f in r["frames"]] for r in ds}
        clips = {r["id"]: r["video"]["bytes"] for r in ds}
    assert {k: len(v) for k, v in frames.items()} == {"a": 9, "b": 5}
    for rid, stored in frames.items():
        assert all(f.size == (64, 48) for f in stored)
        # crf 0: the clip's frames are the PNGs, within yuv420p's chroma rounding, in the same order
        decoded = video_frames(clips[rid])
        diffs = [
            np.abs(np.asarray(a, np.int16) - np.asarray(b, np.int16)).mean()
            for a, b in zip(stored, decoded, strict=True)
        ]
        assert max(diffs) < 4
    report = verify(str(out), deep=True)
    assert report.clean, report.to_dict()

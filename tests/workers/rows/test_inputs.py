"""Image inputs: img2img, inpaint and an edit model (FLUX.1 Kontext) on the tiny pipelines, with
input images as Parquet bytes, `datasets` Image structs, local paths and `s3://` URLs on the
loopback S3 server; bad inputs as error rows; what each image records; `--store-inputs`."""

from __future__ import annotations

import hashlib
import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

import fleetgen.workers.rows.inputs
from fleetgen.jobs.sharding import plan_shards, read_footer, resolve_columns
from fleetgen.workers.rows.inputs import InputRef, Prefetcher, fitted, load, refs_of
from fleetgen.workers.rows.shard import Columns
from fleetgen.workers.spec import GenerationSettings, WorkerSpec
from fleetgen.workers.tiny import write_tiny_model
from fleetgen.workers.worker import Worker
from tests.conftest import png

STRUCT = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


def pixels(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=np.int16)


def run(model, tmp_path, rows: dict, task: str, family: str = "sd", name="out", **settings):
    """One shard of `rows` through a worker (no Ray); returns (manifest rows by id, output dir)."""
    path = tmp_path / f"{name}.parquet"
    pq.write_table(pa.table(rows), path)
    files = [read_footer(str(path))]
    wanted = {k: k for k in ("strength",) if k in rows}
    columns = resolve_columns(
        files, Columns.of(image="input_image", mask="mask_image" if "mask_image" in rows else None, **wanted)
    )
    base = {"steps": 2, "guidance": 5.0, "width": 64, "height": 64, "output_format": "parquet"}
    s = GenerationSettings(task=task, family=family, **{**base, **settings})
    out = tmp_path / name
    worker = Worker(WorkerSpec.of("w0", str(model), str(out), s, columns, max_batch=4, device="cpu", threads=1))
    try:
        worker.run_shard(plan_shards(files, 100)[0])
    finally:
        worker.close()
    manifest = pq.read_table(out / "shards" / "shard-00000.parquet").to_pylist()
    return {r["id"]: r for r in manifest}, out


def stored(out) -> dict[str, dict]:
    table = pq.read_table(out / "data" / "shard-00000.parquet")
    return {r["id"]: r for r in table.to_pylist()}


@pytest.fixture(scope="module")
def kontext(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("kontext") / "m", family="flux-kontext")


def test_column_values_name_their_inputs():
    base = "s3://bucket/in/rows.parquet"
    assert refs_of(b"\x89PNG", "image", base)[0] == [InputRef("image", "bytes", b"\x89PNG")]
    assert refs_of({"bytes": b"x", "path": "a.png"}, "image", base)[0] == [InputRef("image", "a.png", b"x")]
    assert refs_of({"bytes": None, "path": "a.png"}, "image", base)[0] == [InputRef("image", "s3://bucket/in/a.png")]
    assert refs_of("../pics/b.png", "image", "/data/in/rows.parquet")[0] == [InputRef("image", "/data/pics/b.png")]
    assert refs_of("gs://b/c.png", "image", base)[0] == [InputRef("image", "gs://b/c.png")]
    assert [r.source for r in refs_of(["a.png", "b.png"], "image", base)[0]] == [
        "s3://bucket/in/a.png",
        "s3://bucket/in/b.png",
    ]
    assert refs_of(None, "image", base) == ([], None) and refs_of("  ", "image", base) == ([], None)
    assert "neither `bytes` nor `path`" in refs_of({"url": "x"}, "image", base)[1]
    assert "holds a int" in refs_of(3, "image", base)[1]


def test_resize_rules_keep_or_fill_as_stated():
    wide = Image.new("RGB", (200, 100), "white")
    wide.paste(Image.new("RGB", (100, 100), "red"), (50, 0))  # red middle, white sides
    crop = np.asarray(fitted(wide, 64, 64, "crop"))
    assert crop.shape == (64, 64, 3) and (crop[:, :, 1] < 30).mean() > 0.95  # the red middle only
    pad = np.asarray(fitted(wide, 64, 64, "pad"))
    assert pad.shape == (64, 64, 3) and pad[:10].max() == 0 and pad[-10:].max() == 0  # black bands
    assert pad[32, 2].tolist() == [255, 255, 255]  # the whole width kept
    fit = np.asarray(fitted(wide, 64, 64, "fit"))
    assert (
        fit.shape == (64, 64, 3) and fit[32, 2].tolist() == [255, 255, 255] and fit[0].sum(axis=-1).min() > 0
    )  # no bands


def test_oversized_corrupt_and_truncated_inputs_say_why(tmp_path):
    huge = io.BytesIO()
    Image.new("L", (20_000, 8)).save(huge, "PNG")  # 20,000 px wide, a few hundred bytes
    with pytest.raises(ValueError, match=r"20000x8 px; inputs may be at most 16384 px a side"):
        load(InputRef("image", "bytes", huge.getvalue()), 64, 64, "crop")
    with pytest.raises(ValueError, match="not an image"):
        load(InputRef("image", "bytes", b"GIF89a but not really"), 64, 64, "crop")
    with pytest.raises(ValueError, match="damaged image"):
        load(InputRef("image", "bytes", png("red")[:-40]), 64, 64, "crop")


def test_prefetch_reads_ahead_within_its_window():
    from dataclasses import dataclass

    from fleetgen.workers.rows.batches import Look

    @dataclass(frozen=True)
    class Im:
        id: str
        inputs: tuple
        look: Look = Look(64, 64, 2, 5.0)

    refs = [(InputRef("image", "bytes", png("red", (8, 8 + i))),) for i in range(10)]
    images = [Im(str(i), refs[i]) for i in range(10)] + [Im("9-again", refs[9])]  # a row's second image
    reads = []

    real = fleetgen.workers.rows.inputs.load_all
    fleetgen.workers.rows.inputs.load_all = lambda *a: (reads.append(a[0]), real(*a))[1]
    prefetch = Prefetcher(images, "crop", window=3, threads=2)
    try:
        assert prefetch.take(images[0])[1] is None
        assert len(prefetch.futures) <= 3  # never more than the window read ahead
        assert {k[0] for k in prefetch.futures} <= set(refs[1:4])
        loaded, why = prefetch.take(images[5])  # out of order: read now, not lost
        assert why is None and loaded[0].picture.size == (64, 64)
        assert all(prefetch.take(im)[1] is None for im in images[1:5] + images[6:])
        assert not prefetch.futures and sorted(reads, key=refs.index) == refs  # each read once, the repeat too
    finally:
        prefetch.close()
        fleetgen.workers.rows.inputs.load_all = real


def test_img2img_from_bytes_structs_and_paths_with_strength_per_row(tiny_model, tmp_path):
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "g.png").write_bytes(png("green"))
    (tmp_path / "bad.png").write_bytes(b"not an image at all")
    huge = io.BytesIO()
    Image.new("L", (20_000, 8)).save(huge, "PNG")
    (tmp_path / "huge.png").write_bytes(huge.getvalue())
    red = png("red")
    rows = {
        "id": ["bytes", "struct", "path", "weak", "strong", "missing", "corrupt", "huge", "none"],
        "prompt": ["a photo"] * 9,
        "input_image": pa.array(
            [
                {"bytes": red, "path": None},
                {"bytes": red, "path": "red.png"},
                {"bytes": None, "path": "pics/g.png"},
                {"bytes": red, "path": None},
                {"bytes": red, "path": None},
                {"bytes": None, "path": "pics/nope.png"},
                {"bytes": None, "path": "bad.png"},
                {"bytes": None, "path": "huge.png"},
                {"bytes": red, "path": None},
            ],
            STRUCT,
        ),
        "strength": [None, None, None, 0.3, 0.95, None, None, None, 0.2],
        "seed": [7] * 9,  # one seed: images differ only by their inputs and strength
    }
    records, out = run(tiny_model, tmp_path, rows, "image-to-image", strength=0.6, steps=4)
    ok = {k for k, r in records.items() if r["status"] == "ok"}
    assert ok == {"bytes", "struct", "path", "weak", "strong"}
    assert records["missing"]["error"] == f"input image `{tmp_path}/pics/nope.png` not found"
    assert "not an image" in records["corrupt"]["error"] and "bad.png" in records["corrupt"]["error"]
    assert "20000x8 px" in records["huge"]["error"]
    assert records["none"]["error"].startswith("strength 0.2 at 4 steps leaves no denoising step")
    assert records["bytes"]["strength"] == pytest.approx(0.6) and records["weak"]["strength"] == pytest.approx(0.3)
    # what each image was made from: the bytes' sha256, whatever named them; a file's version too
    import hashlib

    digest = hashlib.sha256(red).hexdigest()
    assert records["bytes"]["inputs"] == [
        {"role": "image", "source": "bytes", "sha256": digest, "width": 96, "height": 80, "version": None}
    ]
    assert records["struct"]["inputs"][0]["sha256"] == digest and records["struct"]["inputs"][0]["source"] == "red.png"
    assert (
        records["path"]["inputs"][0]["source"] == f"{tmp_path}/pics/g.png" and records["path"]["inputs"][0]["version"]
    )
    images = {k: pixels(v["image"]["bytes"]) for k, v in stored(out).items()}
    assert (images["bytes"] == images["struct"]).all()  # same bytes in, same seed: same image
    diff = np.abs(images["bytes"] - images["path"])
    assert diff.max() > 8 and diff.mean() > 0.5  # another input, another image (rounding is ≤ 2 levels)
    # strength per row changes the image (measured: 40 and 17 levels apart from 0.6's, on average)
    assert np.abs(images["weak"] - images["bytes"]).mean() > 5 and np.abs(images["strong"] - images["bytes"]).mean() > 5


def test_inpaint_repaints_only_where_the_mask_is_white(tiny_model, tmp_path):
    red = png("red", (64, 64))
    black, white = (png(c, (64, 64)) for c in ("black", "white"))
    half = Image.new("L", (64, 64), 0)
    half.paste(255, (0, 0, 32, 64))  # repaint the left half, keep the right
    buf = io.BytesIO()
    half.save(buf, "PNG")
    rows = {
        "id": ["keep", "repaint", "half", "nomask"],
        "prompt": ["a photo"] * 4,
        "input_image": [red] * 4,
        "mask_image": [black, white, buf.getvalue(), None],
        "seed": [3] * 4,
    }
    records, out = run(tiny_model, tmp_path, rows, "inpaint", strength=1.0)
    assert records["nomask"]["status"] == "error" and "no mask" in records["nomask"]["error"]
    assert [x["role"] for x in records["keep"]["inputs"]] == ["image", "mask"]
    images = {k: pixels(v["image"]["bytes"]) for k, v in stored(out).items()}
    # where the mask is black the input's latents are kept; where white the pipeline repaints
    kept, repainted = np.abs(images["half"] - images["keep"]), np.abs(images["half"] - images["repaint"])
    assert kept[:, 48:].mean() + 5 < kept[:, :16].mean()  # the kept right side is the all-kept image's
    assert repainted[:, :16].mean() + 5 < repainted[:, 48:].mean()  # the repainted left the all-repainted's


def test_an_edit_model_batches_its_inputs_as_it_makes_them_alone(kontext, tmp_path):
    """FLUX.1 Kontext: each row's input goes with its own prompt in a batched call; the size asked
    is the size made (its max_area pinned, its auto-resize off)."""
    rows = {
        "id": ["r", "g", "b"],
        "prompt": ["make it night"] * 3,
        "input_image": [png("red"), png("green"), png("blue")],
    }
    batched, out_b = run(kontext, tmp_path, rows, "edit", "flux-kontext", "batched", guidance=2.5)
    assert all(r["status"] == "ok" and r["batch"] == 3 for r in batched.values())
    alone_rows = {k: [v[1]] for k, v in rows.items()}
    alone, out_a = run(kontext, tmp_path, alone_rows, "edit", "flux-kontext", "alone", guidance=2.5)
    a, b = pixels(stored(out_a)["g"]["image"]["bytes"]), pixels(stored(out_b)["g"]["image"]["bytes"])
    assert a.shape == (64, 64, 3) and np.abs(a - b).max() <= 3  # batch-level rounding only (DESIGN: Seeds)
    others = pixels(stored(out_b)["r"]["image"]["bytes"])
    assert np.abs(others - b).mean() > 1  # another input, another image


@pytest.mark.slow
@pytest.mark.parametrize("task", ["image-to-image", "inpaint", "edit"])
def test_inputs_from_s3_urls_and_local_paths(task, tiny_model, kontext, s3_server, tmp_path):
    """Each task with its inputs at `s3://` URLs on the loopback S3 server and at local paths (a
    missing key is an error row): SD img2img and inpaint (masks too), FLUX.1 Kontext edit."""
    import s3fs

    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_server}, key="k", secret="s")
    bucket = f"inputs-{task}"
    fs.mkdirs(bucket, exist_ok=True)
    fs.pipe(f"{bucket}/pics/a.png", png("red"))
    fs.pipe(f"{bucket}/masks/a.png", png("white"))
    (tmp_path / "b.png").write_bytes(png("blue"))
    (tmp_path / "mask.png").write_bytes(png("white"))
    rows = {
        "id": ["s3", "local", "gone"],
        "prompt": ["a photo"] * 3,
        "input_image": [f"s3://{bucket}/pics/a.png", "b.png", f"s3://{bucket}/pics/gone.png"],
    }
    if task == "inpaint":
        rows["mask_image"] = [f"s3://{bucket}/masks/a.png", "mask.png", "mask.png"]
    model, family = (kontext, "flux-kontext") if task == "edit" else (tiny_model, "sd")
    strength = {} if task == "edit" else {"strength": 0.5 if task == "image-to-image" else 1.0}
    records, out = run(model, tmp_path, rows, task, family, guidance=2.5 if task == "edit" else 5.0, **strength)
    assert records["s3"]["status"] == records["local"]["status"] == "ok", records
    assert records["gone"]["error"] == f"input image `s3://{bucket}/pics/gone.png` not found"
    assert records["s3"]["inputs"][0]["version"].startswith(f"{len(png('red'))}:")  # size and ETag
    assert records["local"]["inputs"][0]["source"] == str(tmp_path / "b.png")
    if task == "inpaint":
        assert records["s3"]["inputs"][1] == {
            **records["s3"]["inputs"][1],
            "role": "mask",
            "source": f"s3://{bucket}/masks/a.png",
        }
    assert len(stored(out)) == 2


def test_stored_inputs_load_with_datasets_beside_the_output(tiny_model, tmp_path):
    import datasets

    rows = {"id": ["a", "b"], "prompt": ["a photo"] * 2, "input_image": [png("red"), png("blue")]}
    _, out = run(tiny_model, tmp_path, rows, "image-to-image", strength=0.5, store_inputs=True)
    ds = datasets.load_dataset("parquet", data_files=str(out / "data" / "*.parquet"), split="train")
    assert ds.features["input_image"] == datasets.Image() and ds.features["image"] == datasets.Image()
    first = ds[0]
    assert first["input_image"].size == first["image"].size == (64, 64)
    assert np.asarray(first["input_image"].convert("RGB"))[32, 32].tolist() == [255, 0, 0]


def test_flux2_edits_from_a_list_of_references_one_row_per_call(tmp_path):
    model = write_tiny_model(tmp_path / "flux2", family="flux2")
    rows = {
        "id": ["one", "two", "eleven"],
        "prompt": ["combine them"] * 3,
        "input_image": [[png("red")], [png("red"), png("blue")], [png("red")] * 11],
    }
    records, out = run(model, tmp_path, rows, "edit", "flux2", guidance=4.0)
    assert records["one"]["status"] == records["two"]["status"] == "ok"
    assert [x["sha256"][:8] for x in records["two"]["inputs"]] == [
        hashlib.sha256(png(c)).hexdigest()[:8] for c in ("red", "blue")
    ]
    assert {records["one"]["batch"], records["two"]["batch"]} == {1}  # one list of references per call
    assert records["eleven"]["error"] == "11 input images in column `input_image`; this task takes at most 10"


def test_stored_inputs_in_webdataset_are_members_beside_each_sample(tiny_model, tmp_path):
    import json
    import tarfile

    rows = {
        "id": ["a", "b"],
        "prompt": ["a photo"] * 2,
        "input_image": [png("red"), png("blue")],
        "mask_image": [png("white"), png("black")],
    }
    _, out = run(tiny_model, tmp_path, rows, "inpaint", output_format="webdataset", store_inputs=True)
    with tarfile.open(out / "data" / "shard-00000.tar") as tar:
        names = tar.getnames()
        meta = json.loads(tar.extractfile("a.json").read())
        mask = Image.open(io.BytesIO(tar.extractfile("b.mask.png").read()))
    assert names == ["a.png", "a.input.png", "a.mask.png", "a.json", "b.png", "b.input.png", "b.mask.png", "b.json"]
    assert "_extra" not in meta and [x["role"] for x in meta["inputs"]] == ["image", "mask"]
    assert mask.size == (64, 64) and mask.getextrema() == (0, 0)


def test_inputs_over_https_urls_through_fsspec(tiny_model, tmp_path):
    """`https://` (here plain http on loopback) inputs are read through fsspec's HTTP filesystem; a
    404 is a missing input, an error row."""
    import functools
    import http.server
    import threading

    site = tmp_path / "site"
    site.mkdir()
    (site / "a.png").write_bytes(png("red"))

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(Quiet, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        rows = {"id": ["a", "gone"], "prompt": ["a photo"] * 2, "input_image": [f"{base}/a.png", f"{base}/gone.png"]}
        records, _ = run(tiny_model, tmp_path, rows, "image-to-image", strength=0.5)
    finally:
        server.shutdown()
    assert records["a"]["status"] == "ok" and records["a"]["inputs"][0]["source"] == f"{base}/a.png"
    assert records["a"]["inputs"][0]["sha256"] == hashlib.sha256(png("red")).hexdigest()
    assert records["gone"]["status"] == "error" and f"{base}/gone.png" in records["gone"]["error"]

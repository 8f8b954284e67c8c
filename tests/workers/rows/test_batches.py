"""Rows → work items → batches (workers/rows/batches.py): settings per row, looks, templates, ids, the
columns checked before any worker; a worker batching by look."""

import io
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from fleetgen.errors import InputError
from fleetgen.jobs.sharding import plan_shards, read_footer, resolve_columns
from fleetgen.workers.rows.batches import Adapter, Look, Recipe, group_items, shard_items
from fleetgen.workers.rows.shard import Columns, read_shard
from fleetgen.workers.spec import GenerationSettings, WorkerSpec
from fleetgen.workers.worker import Worker


def write(path, **columns):
    pq.write_table(pa.table(columns), path)
    return str(path)


def images_of(path, columns=None, **recipe):
    files = [read_footer(path)]
    cols = resolve_columns(files, columns or Columns(), recipe.get("template"))
    shard = plan_shards(files, 100)[0]
    return shard_items(shard, read_shard(shard, cols), cols, Recipe(Look(64, 64, 2, 5.0), **recipe))


def make_batches(images, batch_size: int):
    """As the worker cuts them: each look's images in order, `batch_size` at a time."""
    return [g[i : i + batch_size] for g in group_items(images) for i in range(0, len(g), batch_size)]


def test_rows_become_images_with_their_settings(tmp_path):
    path = write(
        tmp_path / "p.parquet",
        prompt=["a", "b", "c", "d", "e", "f"],
        id=["r0", "r1", "r2", "r3", "r4", "r5"],
        num_images=pa.array([2, None, 0, 1, 3, 1], pa.int32()),
        width=pa.array([128, None, 64, 65, None, 64], pa.int32()),
        steps=pa.array([None, 3, 2, 2, 0, 2], pa.int32()),
        guidance=[None, 2.5, float("nan"), 1.0, 1.0, math.inf],
        seed=pa.array([None, None, None, None, 7, None], pa.int64()),
    )
    columns = Columns.of(num_images="num_images", width="width", steps="steps", guidance="guidance")
    images = images_of(path, columns, images_per_prompt=2, seed=5)
    by_id = {im.id: im for im in images}
    # ids are <row id>-<k>; num_images overrides --images-per-prompt (null: the job's 2)
    assert [im.id for im in images if im.row_id in ("r0", "r1")] == ["r0-0", "r0-1", "r1-0", "r1-1"]
    assert by_id["r0-0"].look == Look(128, 64, 2, 5.0) and by_id["r1-1"].look == Look(64, 64, 3, 2.5)
    # invalid values are error images with the reason (never an exception); NaN guidance is "unset"
    assert by_id["r2-0"].error == "num_images `0` is out of range [1, 1000]"
    assert by_id["r3-0"].error == "width `65` is not a multiple of 8, which the model needs"
    assert [by_id[f"r4-{k}"].error for k in range(3)] == ["steps `0` is out of range [1, 1000]"] * 3
    assert by_id["r5-0"].error == "guidance `inf` is not a finite number"
    # seeds: distinct, stable, from (job seed, image id); a row's seed column gives seed + k
    seeds = [im.seed for im in images if im.error is None]
    assert len(set(seeds)) == len(seeds)
    assert [im.seed for im in images_of(path, columns, images_per_prompt=2, seed=5)] == [im.seed for im in images]
    assert images_of(path, columns, images_per_prompt=2, seed=6)[0].seed != images[0].seed
    r4 = images_of(
        write(tmp_path / "q.parquet", prompt=["x"], id=["r4"], seed=pa.array([7], pa.int64())), images_per_prompt=3
    )
    assert [im.seed for im in r4] == [7, 8, 9]


def test_batches_share_a_look_and_keep_order(tmp_path):
    a, b = Adapter("a"), Adapter("b", 0.5)
    looks = [Look(64, 64, 2, 5.0), Look(128, 64, 2, 5.0), Look(64, 64, 2, 5.0, (a,)), Look(64, 64, 2, 5.0, (b,))]
    from fleetgen.workers.rows.batches import WorkItem as Img

    images = [Img(f"i{n}", f"i{n}", 0, n, "p", None, n, looks[n % 4], None) for n in range(14)]
    images.append(Img("bad", "bad", 0, 14, "p", None, None, looks[0], "prompt is null or empty"))
    batches = make_batches(images, 3)
    assert all(len({im.look for im in batch}) == 1 and len(batch) <= 3 for batch in batches)
    assert [im.id for im in batches[0]] == ["i0", "i4", "i8"]  # first look first, rows in order
    assert sorted(im.id for batch in batches for im in batch) == sorted(f"i{n}" for n in range(14))  # error left out
    assert len(batches) == 6  # 4 looks: 4+4+3+3 images -> 2+2+1+1 calls


def test_template_renders_from_columns(tmp_path):
    path = write(tmp_path / "p.parquet", label=["cat", None], style=["photo", "sketch"], n=pa.array([1, 2], pa.int8()))
    images = images_of(path, template="a {style} of a {label} #{n:02d}")
    assert images[0].prompt == "a photo of a cat #01"
    assert images[1].error == "template column `label` is null"


def test_columns_are_checked_before_any_worker(tmp_path):
    path = write(tmp_path / "p.parquet", label=["cat"], prompt=["x"], status=["new"], steps=["thirty"])
    files = [read_footer(path)]
    with pytest.raises(InputError) as err:
        resolve_columns(files, Columns(), "a {style} of a {label}")
    assert "`--prompt-template` names column `style`" in str(err.value)
    assert "(columns: label, prompt, status, steps)" in str(err.value)
    with pytest.raises(InputError, match="`--drop-columns status`"):  # would clash with the manifest's own
        resolve_columns(files, Columns())
    with pytest.raises(InputError, match="Column `steps` .* has type string; the steps column must be an integer"):
        resolve_columns(files, Columns.of(steps="steps"), keep=["label"])
    assert resolve_columns(files, Columns(), keep=["label", "prompt"]).carry == ("label",)  # roles: manifest columns
    assert resolve_columns(files, Columns(), drop=["status", "steps"]).carry == ("label",)
    with pytest.raises(InputError, match="`--keep-columns` names `nope`"):
        resolve_columns(files, Columns(), keep=["nope"])
    # a template may read a column that is not carried; the prompt column is not a role then
    cols = resolve_columns(files, Columns(), "{prompt} as a {label}", drop=["prompt", "status", "steps"])
    assert (cols["prompt"], cols.template_fields, cols.carry) == (None, ("prompt", "label"), ("label",))


def test_mixed_sizes_and_adapters_batch_by_look(tiny_model, tmp_path):
    """Rows of 2 sizes x (no adapter, adapter A, adapter B): each pipeline call holds one look, each
    image records its own settings, an adapter changes the image and its bytes are planned for."""
    from fleetgen.workers.tiny import write_tiny_lora

    a = str(write_tiny_lora(tmp_path / "loras" / "a.safetensors", tiny_model, seed=1))
    b = str(write_tiny_lora(tmp_path / "loras" / "b.safetensors", tiny_model, seed=2))
    n = 12
    path = write(
        tmp_path / "p.parquet",
        prompt=["a lighthouse at dawn"] * n,
        id=[f"r{i}" for i in range(n)],
        seed=pa.array([42] * n, pa.int64()),
        width=pa.array([64, 128] * (n // 2), pa.int32()),
        lora=[[None, a, b][i % 3] for i in range(n)],
        lora_scale=[None, None, 0.5] * (n // 3),
    )
    files = [read_footer(path)]
    cols = resolve_columns(files, Columns.of(width="width", lora="lora", lora_scale="lora_scale"))
    settings = GenerationSettings(
        family="sd", task="text-to-image", steps=2, guidance=5.0, width=64, height=64, output_format="parquet"
    )
    spec = WorkerSpec.of(
        "w0",
        tiny_model,
        str(tmp_path / "out"),
        settings,
        cols,
        max_batch=4,
        device="cpu",
        adapters=((a, a), (b, b)),
        plan_size=(128, 64),
    )
    worker = Worker(spec)
    plain = Worker(WorkerSpec.of("w1", tiny_model, str(tmp_path / "plain"), settings, cols, device="cpu"))
    assert worker.profile.total_bytes > plain.profile.total_bytes  # the adapters' bytes are planned for
    result = worker.run_shard(plan_shards(files, 100)[0])
    assert (result.ok, result.errors) == (n, 0)
    rows = pq.read_table(tmp_path / "out" / "shards").to_pylist()
    for r in rows:
        i = int(r["id"][1:])
        assert (r["width"], r["height"]) == ((64, 128)[i % 2], 64)
        assert r["lora"] == [[], [a], [b]][i % 3] and r["lora_scale"] == [[], [1.0], [0.5]][i % 3]
        assert r["batch"] == 2  # 6 looks of 2 images each: one call per look
    data = pq.read_table(tmp_path / "out" / "data").to_pylist()
    sizes = {d["id"]: Image.open(io.BytesIO(d["image"]["bytes"])).size for d in data}
    assert sizes["r0"] == (64, 64) and sizes["r1"] == (128, 64)
    by_id = {r["id"]: r["sha256"] for r in rows}
    # same prompt, seed and size: r0 (no adapter), r4 (A), r2 (B) -> three different images
    assert len({by_id["r0"], by_id["r4"], by_id["r2"]}) == 3
    # and the adapter was switched off again: r6 (no adapter, after A and B ran) is r0's image
    assert by_id["r6"] == by_id["r0"]

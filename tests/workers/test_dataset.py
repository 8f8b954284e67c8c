"""Dataset synthesis: the dataset drives the generation (templates, per-row settings, N images per
row, LoRA) and the output is a dataset that real readers take as it is (`datasets`, `webdataset`,
`wids`, from PyPI)."""

import hashlib
import io
import json
import math
import tarfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from fleetgen.errors import ConfigError, InputError
from fleetgen.jobs.config import JobConfig, make_config, validate
from fleetgen.jobs.sharding import plan_shards, read_footer, resolve_columns
from fleetgen.workers.rows.batches import Adapter, Look, Recipe, group_items, shard_items
from fleetgen.workers.rows.shard import Columns, read_shard
from fleetgen.workers.spec import GenerationSettings, WorkerSpec
from fleetgen.workers.worker import Worker
from tests.conftest import FAST

LABELS = ["cat", "dog", "owl"]
STYLES = ["photo", "sketch"]
TEMPLATE = "a {style} of a {label}"


def write(path, **columns):
    pq.write_table(pa.table(columns), path)
    return str(path)


def images_of(path, columns=None, **recipe):
    files = [read_footer(path)]
    cols = resolve_columns(files, columns or Columns(), recipe.get("template"))
    shard = plan_shards(files, 100)[0]
    return shard_items(shard, read_shard(shard, cols), cols, Recipe(Look(64, 64, 2, 5.0), **recipe))


# --- rows → images → batches (pure) -------------------------------------------------------------


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
    columns = Columns(num_images="num_images", width="width", steps="steps", guidance="guidance")
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


def make_batches(images, batch_size: int):
    """As the worker cuts them: each look's images in order, `batch_size` at a time."""
    return [g[i : i + batch_size] for g in group_items(images) for i in range(0, len(g), batch_size)]


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
        resolve_columns(files, Columns(steps="steps"), keep=["label"])
    assert resolve_columns(files, Columns(), keep=["label", "prompt"]).carry == ("label",)  # roles: manifest columns
    assert resolve_columns(files, Columns(), drop=["status", "steps"]).carry == ("label",)
    with pytest.raises(InputError, match="`--keep-columns` names `nope`"):
        resolve_columns(files, Columns(), keep=["nope"])
    # a template may read a column that is not carried; the prompt column is not a role then
    cols = resolve_columns(files, Columns(), "{prompt} as a {label}", drop=["prompt", "status", "steps"])
    assert (cols.prompt, cols.template_fields, cols.carry) == (None, ("prompt", "label"), ("label",))


def test_synthesis_options_are_validated(tmp_path):
    lora = tmp_path / "a.safetensors"
    lora.write_bytes(b"")
    config = make_config(
        {
            "input": "p",
            "output": "o",
            "model": "org/m",
            "lora": [f"{lora}:0.7", "org/style-lora"],
            "prompt_template": "a {x}",
            "images_per_prompt": 4,
        }
    )
    assert config.lora == (f"{lora}:0.7", "org/style-lora")
    from fleetgen.jobs.config import parse_lora

    assert parse_lora(f"{lora}:0.7") == Adapter(str(lora), 0.7)
    assert parse_lora("org/style-lora") == Adapter("org/style-lora", 1.0)
    base = {"input": "p", "output": "o", "model": "org/m"}
    for bad, message in (
        ({"lora": ("missing.safetensors",)}, "neither an existing file"),
        ({"prompt_template": "a {}"}, "`{}` is not a column name"),
        ({"prompt_template": "a {x.y}"}, "`{x.y}` is not a column name"),
        ({"images_per_prompt": 0}, "`--images-per-prompt` must be 1 to 1000"),
        ({"keep_columns": "a", "drop_columns": "b"}, "pass one of them"),
    ):
        with pytest.raises(ConfigError, match=message):
            validate(JobConfig(**base, **bad))


# --- whole jobs ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def classes(tmp_path_factory):
    """3 classes x 2 styles, with a class index, a list column and an id."""
    rows = [(label, style) for label in LABELS for style in STYLES]
    return write(
        tmp_path_factory.mktemp("classes") / "labels.parquet",
        id=[f"{lab}-{sty}" for lab, sty in rows],
        label=[lab for lab, _ in rows],
        style=[sty for _, sty in rows],
        class_id=pa.array([LABELS.index(lab) for lab, _ in rows], pa.int16()),
        tags=[[lab, sty] for lab, sty in rows],
    )


def synth(classes, model, out, **kw) -> JobConfig:
    return validate(
        JobConfig(
            input=classes,
            output=str(out),
            model=model,
            prompt_template=TEMPLATE,
            **{"images_per_prompt": 3, "rows_per_shard": 3, "max_batch": 4, **FAST, **kw},
        )
    )


def test_template_job_is_a_dataset_for_real_readers(ray_cluster, tiny_model, classes, tmp_path):
    import datasets

    from fleetgen.jobs.driver import run_job

    out = tmp_path / "pq"
    summary = run_job(
        synth(classes, tiny_model, out, output_format="parquet", workers=1), progress_stream=io.StringIO()
    )
    assert summary.complete and summary.images_ok == 18
    manifest = pq.read_table(out / "shards").to_pylist()
    ids = sorted(r["id"] for r in manifest)
    assert ids == sorted(f"{lab}-{sty}-{k}" for lab in LABELS for sty in STYLES for k in range(3))
    for r in manifest:
        assert r["prompt"] == f"a {r['style']} of a {r['label']}" and r["template"] == TEMPLATE
        assert r["class_id"] == LABELS.index(r["label"]) and r["tags"] == [r["label"], r["style"]]
        assert r["id"] == f"{r['row_id']}-{r['image_index']}"
    assert len({r["seed"] for r in manifest}) == 18
    schema = pq.read_schema(next((out / "shards").iterdir()))
    assert schema.field("class_id").type == pa.int16() and schema.field("tags").type == pa.list_(pa.string())

    ds = datasets.load_dataset(str(out), split="train")  # through the dataset card's data_files
    assert isinstance(ds.features["image"], datasets.Image) and ds.features["class_id"].dtype == "int16"
    assert len(ds) == 18
    sample = ds[0]
    assert sample["image"].size == (64, 64) and sample["label"] in LABELS and sample["tags"][0] == sample["label"]
    by_id = {r["id"]: r for r in manifest}
    assert all(by_id[s["id"]]["seed"] == s["seed"] and by_id[s["id"]]["label"] == s["label"] for s in ds)
    card = (out / "README.md").read_text()
    assert "**18 images**" in card and "`class_id` | int16 | from the input" in card and TEMPLATE in card

    # a rerun is the same job: nothing to do, nothing duplicated
    again = run_job(synth(classes, tiny_model, out, output_format="parquet", workers=1), progress_stream=io.StringIO())
    assert again.shards_skipped == 2 and len(datasets.load_dataset(str(out), split="train")) == 18


def test_webdataset_output_reads_with_webdataset_and_wids(ray_cluster, tiny_model, classes, tmp_path):
    import webdataset as wds
    import wids

    from fleetgen.jobs.driver import run_job

    out = tmp_path / "wds"
    run_job(
        synth(classes, tiny_model, out, output_format="webdataset", images_per_prompt=1, workers=1),
        progress_stream=io.StringIO(),
    )
    tars = sorted(str(p) for p in (out / "data").glob("*.tar"))
    assert [p.rsplit("/", 1)[1] for p in tars] == ["shard-00000.tar", "shard-00001.tar"]
    samples = list(wds.WebDataset(tars, shardshuffle=False).decode("pil"))
    assert sorted(s["__key__"] for s in samples) == sorted(f"{lab}-{sty}" for lab in LABELS for sty in STYLES)
    for s in samples:
        meta = s["json"]
        assert s["png"].size == (64, 64) and meta["class_id"] == LABELS.index(meta["label"])
        assert meta["prompt"] == f"a {meta['style']} of a {meta['label']}"
    index = json.loads((out / "wids-index.json").read_text())
    assert [(e["url"], e["nsamples"]) for e in index["shardlist"]] == [
        ("data/shard-00000.tar", 3),
        ("data/shard-00001.tar", 3),
    ]
    ds = wids.ShardListDataset(str(out / "wids-index.json"), cache_dir=str(tmp_path / "wids-cache"))
    assert len(ds) == 6
    assert {ds[i][".json"]["label"] for i in range(len(ds))} == set(LABELS)
    assert ds[0][".png"].size == (64, 64)


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
    cols = resolve_columns(files, Columns(width="width", lora="lora", lora_scale="lora_scale"))
    settings = GenerationSettings(steps=2, guidance=5.0, width=64, height=64, output_format="parquet")
    spec = WorkerSpec(
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
    plain = Worker(WorkerSpec("w1", tiny_model, str(tmp_path / "plain"), settings, cols, device="cpu"))
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


def test_retry_errors_redoes_exactly_the_error_rows(ray_cluster, tiny_model, tmp_path):
    """Run 1 with --strict-prompts: the over-long prompts are error rows. Run 2 with --retry-errors:
    only those rows are generated, the ok images' bytes are kept, every shard commits again."""
    from fleetgen.jobs.driver import run_job

    long = " ".join(["a very long prompt about a red fox"] * 20)  # > 77 CLIP tokens
    prompts = ["a cat", long, "a dog", "an owl", long, "a cow"]
    path = write(tmp_path / "p.parquet", prompt=prompts, id=[f"p{i}" for i in range(6)])
    config = validate(
        JobConfig(
            input=path,
            output=str(tmp_path / "out"),
            model=tiny_model,
            output_format="webdataset",
            rows_per_shard=3,
            max_batch=3,
            workers=1,
            strict_prompts=True,
            **FAST,
        )
    )
    first = run_job(config, progress_stream=io.StringIO())
    assert (first.images_ok, first.images_error) == (4, 2)

    def members(shard):
        with tarfile.open(tmp_path / "out" / "data" / f"{shard}.tar") as tar:
            return {m.name: tar.extractfile(m).read() for m in tar}

    before = {s: members(s) for s in ("shard-00000", "shard-00001")}
    manifest_before = {r["id"]: r for r in pq.read_table(tmp_path / "out" / "shards").to_pylist()}
    log = io.StringIO()
    second = run_job(
        validate(JobConfig(**{**config.to_dict(), "strict_prompts": False, "retry_errors": True})), progress_stream=log
    )
    assert "--retry-errors: 2 committed shard(s) have error rows" in log.getvalue()
    assert (second.images_ok, second.images_error, second.complete) == (6, 0, True)
    after = {r["id"]: r for r in pq.read_table(tmp_path / "out" / "shards").to_pylist()}
    for rid, old in manifest_before.items():
        if old["status"] == "ok":
            assert after[rid] == old  # the record as committed, untouched
        else:
            assert after[rid]["status"] == "ok" and "prompt truncated" in after[rid]["warning"]
    for shard, old in before.items():
        new = members(shard)
        assert all(new[name] == data for name, data in old.items())  # ok images byte for byte
        assert len(new) == len(old) + 2  # + the redone row's image and json
    for r in after.values():
        image = members(r["image"].rsplit("/", 1)[1].removesuffix(".tar"))[r["member"]]
        assert hashlib.sha256(image).hexdigest() == r["sha256"]
    third = run_job(
        validate(JobConfig(**{**config.to_dict(), "strict_prompts": False, "retry_errors": True})),
        progress_stream=io.StringIO(),
    )
    assert third.images_ok == 6 and third.shards_skipped == 2


def test_driver_reads_sizes_from_footers_and_adapters_from_the_column(tmp_path, tiny_model):
    """What the driver learns before any worker starts: the largest size (planned for, from row
    group statistics) and every adapter a row names (refused when it is neither a path nor a hub id)."""
    from fleetgen.jobs.models import resolve_adapters
    from fleetgen.jobs.sharding import distinct_strings, largest

    lora = tmp_path / "a.safetensors"
    lora.write_bytes(b"")
    path = tmp_path / "p.parquet"
    pq.write_table(
        pa.table(
            {
                "prompt": ["x"] * 6,
                "tags": [[1, 2]] * 6,  # a list column: leaf indices shift
                "width": pa.array([64, None, 256, 64, 128, None], pa.int32()),
                "lora": [str(lora), None, "", "org/style", str(lora), None],
            }
        ),
        path,
        row_group_size=2,
    )
    files = [read_footer(str(path))]
    assert largest(files, "width") == 256 and largest(files, None) is None
    pq.write_table(
        pa.table({"prompt": ["y"], "tags": [[3]], "width": pa.array([512], pa.int32()), "lora": [None]}),
        tmp_path / "q.parquet",
        write_statistics=False,
    )  # no statistics: the column is read
    assert largest([*files, read_footer(str(tmp_path / "q.parquet"))], "width") == 512
    values = distinct_strings(files, "lora", 32)
    assert sorted(values) == sorted([str(lora), "", "org/style"])
    config = JobConfig(input=str(path), output="o", model=tiny_model, lora=("org/base:0.5",))
    cols = Columns(lora="lora")
    assert resolve_adapters(config, cols, values) == (
        ("org/base", "org/base"),
        (str(lora), str(lora)),
        ("org/style", "org/style"),
    )
    with pytest.raises(ConfigError, match="Column `lora`: `nope.safetensors` is neither an existing file"):
        resolve_adapters(config, cols, ["nope.safetensors"])
    with pytest.raises(ConfigError, match="more than 32 LoRA adapters"):
        resolve_adapters(config, cols, [f"org/l{i}" for i in range(33)])

"""Dataset synthesis as a job: its options validated, a template job read back by `datasets`, webdataset output
read by `webdataset` and `wids`, `--retry-errors`, sizes and adapters read from the input's footers."""

import hashlib
import io
import json
import tarfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fleetgen.errors import ConfigError
from fleetgen.jobs.config import JobConfig, make_config, validate
from fleetgen.jobs.sharding import read_footer
from fleetgen.workers.rows.batches import Adapter
from fleetgen.workers.rows.shard import Columns
from tests.conftest import FAST

SIZE = (FAST["width"], FAST["height"])  # what every image of these jobs is

LABELS = ["cat", "dog", "owl"]


STYLES = ["photo", "sketch"]


TEMPLATE = "a {style} of a {label}"


def write(path, **columns):
    pq.write_table(pa.table(columns), path)
    return str(path)


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
        JobConfig.of(
            input=classes,
            output=str(out),
            model=model,
            prompt_template=TEMPLATE,
            **{"images_per_prompt": 3, "rows_per_shard": 3, "max_batch": 4, **FAST, **kw},
        )
    )


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
    # parsed where the job is configured: each adapter a record, a local path made absolute
    assert config.generation.lora == (Adapter(str(lora), 0.7), Adapter("org/style-lora", 1.0))
    from fleetgen.workers.rows.batches import parse_lora

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
            validate(JobConfig.of(**base, **bad))


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
    assert sample["image"].size == SIZE and sample["label"] in LABELS and sample["tags"][0] == sample["label"]
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
        assert s["png"].size == SIZE and meta["class_id"] == LABELS.index(meta["label"])
        assert meta["prompt"] == f"a {meta['style']} of a {meta['label']}"
    index = json.loads((out / "wids-index.json").read_text())
    assert [(e["url"], e["nsamples"]) for e in index["shardlist"]] == [
        ("data/shard-00000.tar", 3),
        ("data/shard-00001.tar", 3),
    ]
    ds = wids.ShardListDataset(str(out / "wids-index.json"), cache_dir=str(tmp_path / "wids-cache"))
    assert len(ds) == 6
    assert {ds[i][".json"]["label"] for i in range(len(ds))} == set(LABELS)
    assert ds[0][".png"].size == SIZE


def test_retry_errors_redoes_exactly_the_error_rows(ray_cluster, tiny_model, tmp_path):
    """Run 1 with --strict-prompts: the over-long prompts are error rows. Run 2 with --retry-errors:
    only those rows are generated, the ok images' bytes are kept, every shard commits again."""
    from fleetgen.jobs.driver import run_job

    long = " ".join(["a very long prompt about a red fox"] * 20)  # > 77 CLIP tokens
    prompts = ["a cat", long, "a dog", "an owl", long, "a cow"]
    path = write(tmp_path / "p.parquet", prompt=prompts, id=[f"p{i}" for i in range(6)])
    config = validate(
        JobConfig.of(
            input=path,
            output=str(tmp_path / "out"),
            model=tiny_model,
            output_format="webdataset",
            rows_per_shard=3,
            max_batch=3,
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
        validate(JobConfig.of(**{**config.to_dict(), "strict_prompts": False, "retry_errors": True})),
        progress_stream=log,
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
        validate(JobConfig.of(**{**config.to_dict(), "strict_prompts": False, "retry_errors": True})),
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
    config = JobConfig.of(input=str(path), output="o", model=tiny_model, lora=("org/base:0.5",))
    cols = Columns.of(lora="lora")
    assert resolve_adapters(config, cols, values) == (
        ("org/base", "org/base"),
        (str(lora), str(lora)),
        ("org/style", "org/style"),
    )
    with pytest.raises(ConfigError, match="Column `lora`: `nope.safetensors` is neither an existing file"):
        resolve_adapters(config, cols, ["nope.safetensors"])
    with pytest.raises(ConfigError, match="more than 32 LoRA adapters"):
        resolve_adapters(config, cols, [f"org/l{i}" for i in range(33)])

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bench.shard_read import counting
from fleetgen.errors import InputError
from fleetgen.jobs.sharding import InputFile, list_input_files, plan_shards, read_footer, resolve_columns
from fleetgen.workers.rows.batches import Look, Recipe, shard_items
from fleetgen.workers.rows.shard import SETTING_ROLES, Columns, read_shard
from tests.conftest import write_prompts

NO_SETTINGS = dict.fromkeys(SETTING_ROLES)  # an input with no per-row setting columns


def shard_rows(shard, table, columns, job_seed):
    return shard_items(shard, table, columns, Recipe(Look(64, 64, 2, 5.0), seed=job_seed))


def footers(url):
    return [read_footer(u) for u in list_input_files(url)]


def test_shards_follow_row_groups(tmp_path):
    write_prompts(tmp_path / "p.parquet", [f"p{i}" for i in range(10)], row_group_size=4)
    shards = plan_shards(footers(str(tmp_path / "p.parquet")), rows_per_shard=100)
    assert [(s.row_group, s.offset, s.length) for s in shards] == [(0, 0, 4), (1, 0, 4), (2, 0, 2)]
    assert [s.row_group_start for s in shards] == [0, 4, 8]
    assert [s.id for s in shards] == ["shard-00000", "shard-00001", "shard-00002"]


def test_big_row_group_splits_into_row_ranges(tmp_path):
    write_prompts(tmp_path / "p.parquet", [f"p{i}" for i in range(1000)])  # one row group
    files = footers(str(tmp_path / "p.parquet"))
    assert files[0].row_groups == (1000,)
    shards = plan_shards(files, rows_per_shard=300)
    assert [(s.offset, s.length) for s in shards] == [(0, 300), (300, 300), (600, 300), (900, 100)]
    # a worker reads exactly its rows
    rows = shard_rows(
        shards[3],
        read_shard(shards[3], Columns.of(id=None, seed=None, negative_prompt=None, **NO_SETTINGS)),
        Columns.of(id=None, seed=None, negative_prompt=None, **NO_SETTINGS),
        job_seed=0,
    )
    assert [r.prompt for r in rows] == [f"p{i}" for i in range(900, 1000)]
    assert rows[0].id == "00000-000000900"


def test_a_shard_reads_its_row_group_only_as_far_as_its_last_row(tmp_path, monkeypatch):
    """Rows are exact across decoded batches, and the pages after a shard's end are never fetched."""
    import fleetgen.workers.rows.shard as shard_module

    prompts = [f"a prompt that takes some bytes, number {i}" for i in range(40_000)]
    table = pa.table({"prompt": prompts, "id": [f"i{i}" for i in range(40_000)]})
    pq.write_table(
        table, tmp_path / "p.parquet", data_page_size=32 * 1024, use_dictionary=False, compression="none"
    )  # one row group, pages of 32 KiB
    shards = plan_shards(footers(str(tmp_path / "p.parquet")), rows_per_shard=3_000)
    cols = Columns.of(seed=None, negative_prompt=None, **NO_SETTINGS)
    monkeypatch.setattr(shard_module, "READ_BATCH", 1_000)  # shards cross batch boundaries
    opened = []
    monkeypatch.setattr(shard_module, "url_to_fs", counting(shard_module.url_to_fs, opened))
    for shard in (shards[0], shards[5], shards[-1]):
        table = read_shard(shard, cols)
        assert table.column("prompt").to_pylist() == prompts[shard.offset : shard.offset + shard.length]
    first, last = opened[0].bytes, opened[-1].bytes
    assert first < last / 4  # the first shard stops early; the last reads the whole group


def test_shard_ids_are_stable_across_plans(tmp_path):
    write_prompts(tmp_path / "a.parquet", [f"a{i}" for i in range(7)], row_group_size=3)
    write_prompts(tmp_path / "b.parquet", [f"b{i}" for i in range(5)])
    one = plan_shards(footers(str(tmp_path)), 2)
    two = plan_shards(footers(str(tmp_path)), 2)
    assert one == two
    assert len({s.id for s in one}) == len(one) == 2 + 2 + 1 + 3


def test_several_files_directory_and_glob(tmp_path):
    for name in ("b", "a", "c"):
        write_prompts(tmp_path / f"{name}.parquet", [name])
    (tmp_path / "notes.txt").write_text("not parquet")
    by_dir = list_input_files(str(tmp_path))
    assert [u.rsplit("/", 1)[1] for u in by_dir] == ["a.parquet", "b.parquet", "c.parquet"]
    by_glob = list_input_files(str(tmp_path / "[ab].parquet"))
    assert [u.rsplit("/", 1)[1] for u in by_glob] == ["a.parquet", "b.parquet"]
    shards = plan_shards(footers(str(tmp_path)), 10)
    assert [s.file_index for s in shards] == [0, 1, 2]


def test_empty_file_gives_no_shards(tmp_path):
    write_prompts(tmp_path / "a.parquet", [])
    write_prompts(tmp_path / "b.parquet", ["x", "y"])
    files = footers(str(tmp_path))
    assert files[0].num_rows == 0
    assert [s.path.rsplit("/", 1)[1] for s in plan_shards(files, 10)] == ["b.parquet"]


def test_nulls_become_error_rows_and_seeds_are_used(tmp_path):
    write_prompts(
        tmp_path / "p.parquet",
        ["ok", None, "  ", "fine"],
        seed=pa.array([5, 6, None, None], pa.int64()),
        id=["r0", "r1", "r2", "../r3"],
    )
    files = footers(str(tmp_path / "p.parquet"))
    cols = resolve_columns(files, Columns())
    assert cols == Columns.of("prompt", "id", "seed", None, **NO_SETTINGS)
    shard = plan_shards(files, 10)[0]
    rows = shard_rows(shard, read_shard(shard, cols), cols, job_seed=3)
    assert [r.error is None for r in rows] == [True, False, False, False]
    assert rows[1].error == "prompt is null or empty"
    assert "not safe as an object key" in rows[3].error
    assert rows[0].seed == 5


def test_missing_input_and_not_parquet(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        list_input_files(str(tmp_path / "nope.parquet"))
    with pytest.raises(InputError, match="no `\\*.parquet` files"):
        list_input_files(str(tmp_path))
    (tmp_path / "bad.parquet").write_text("hello")
    with pytest.raises(InputError, match="not a readable Parquet file"):
        read_footer(str(tmp_path / "bad.parquet"))


def test_missing_prompt_column_lists_columns(tmp_path):
    pq.write_table(pa.table({"text": ["a"], "seed": [1]}), tmp_path / "p.parquet")
    with pytest.raises(InputError) as err:
        resolve_columns(footers(str(tmp_path / "p.parquet")), Columns())
    assert "Input column `prompt` not found" in str(err.value)
    assert "(columns: text, seed)" in str(err.value)
    assert "--prompt-column" in str(err.value)


def test_wrong_types_and_schema_drift(tmp_path):
    pq.write_table(pa.table({"prompt": [1, 2]}), tmp_path / "p.parquet")
    with pytest.raises(InputError, match="must be a string"):
        resolve_columns(footers(str(tmp_path / "p.parquet")), Columns())
    (tmp_path / "d").mkdir()
    write_prompts(tmp_path / "d" / "a.parquet", ["x"], seed=pa.array([1], pa.int64()))
    write_prompts(tmp_path / "d" / "b.parquet", ["y"])
    with pytest.raises(InputError, match="all input files must have the same columns"):
        resolve_columns(footers(str(tmp_path / "d")), Columns())


def test_out_of_range_seeds_are_error_rows(tmp_path):
    write_prompts(tmp_path / "p.parquet", ["a", "b", "c"], seed=pa.array([-1, 2**62, None], pa.int64()))
    files = footers(str(tmp_path / "p.parquet"))
    cols = resolve_columns(files, Columns())
    shard = plan_shards(files, 10)[0]
    rows = shard_rows(shard, read_shard(shard, cols), cols, job_seed=0)
    assert rows[0].error == "seed `-1` is out of range [0, 2**63-1]"
    assert (rows[1].error, rows[1].seed) == (None, 2**62)
    assert rows[2].error is None and rows[2].seed is not None  # null: derived from the job seed
    pq.write_table(pa.table({"prompt": ["a"], "seed": [1.5]}), tmp_path / "f.parquet")
    with pytest.raises(InputError, match="the seed column must be an integer"):
        resolve_columns(footers(str(tmp_path / "f.parquet")), Columns())


def test_all_files_empty_is_refused(tmp_path, tiny_model):
    from fleetgen.jobs.config import JobConfig
    from fleetgen.jobs.driver import run_job

    write_prompts(tmp_path / "a.parquet", [])
    with pytest.raises(InputError, match=r"has no rows \(1 file\(s\), all empty\)"):
        run_job(JobConfig.of(input=str(tmp_path / "a.parquet"), output=str(tmp_path / "o"), model=tiny_model))


def test_shard_ids_have_one_width_for_the_job():
    """Past 99,999 shards the ids widen, all of them, so they still sort as numbered."""
    big = InputFile(url="x.parquet", size=0, row_groups=(100_001,), schema=pa.schema([("prompt", pa.string())]))
    ids = [s.id for s in plan_shards([big], 1)]
    assert ids[0] == "shard-000000" and ids[-1] == "shard-100000" and ids == sorted(ids)
    small = InputFile(url="x.parquet", size=0, row_groups=(10,), schema=big.schema)
    assert [s.id for s in plan_shards([small], 5)] == ["shard-00000", "shard-00001"]


def test_footers_are_read_concurrently_in_order(tmp_path):
    from fleetgen.jobs.sharding import read_footers

    for i in range(5):
        write_prompts(tmp_path / f"f{i}.parquet", [f"p{j}" for j in range(i + 1)])
    files = read_footers(list_input_files(str(tmp_path)))
    assert [f.num_rows for f in files] == [1, 2, 3, 4, 5]

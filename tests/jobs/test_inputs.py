"""A resumed image-input job checks its inputs are still the bytes its images were made from (jobs/inputs.py)."""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from fleetgen.jobs.sharding import plan_shards, read_footer, resolve_columns
from fleetgen.workers.rows.shard import Columns
from fleetgen.workers.spec import GenerationSettings, WorkerSpec
from fleetgen.workers.worker import Worker


def png(color, size=(96, 80)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return buf.getvalue()


def run(model, tmp_path, rows: dict, task: str, family: str = "sd", name="out", **settings):
    """One shard of `rows` through a worker (no Ray); returns (manifest rows by id, output dir)."""
    path = tmp_path / f"{name}.parquet"
    pq.write_table(pa.table(rows), path)
    files = [read_footer(str(path))]
    wanted = {k: k for k in ("strength",) if k in rows}
    columns = resolve_columns(
        files, Columns(image="input_image", mask="mask_image" if "mask_image" in rows else None, **wanted)
    )
    base = {"steps": 2, "guidance": 5.0, "width": 64, "height": 64, "output_format": "parquet"}
    s = GenerationSettings(task=task, family=family, **{**base, **settings})
    out = tmp_path / name
    worker = Worker(WorkerSpec("w0", str(model), str(out), s, columns, max_batch=4, device="cpu", threads=1))
    try:
        worker.run_shard(plan_shards(files, 100)[0])
    finally:
        worker.close()
    manifest = pq.read_table(out / "shards" / "shard-00000.parquet").to_pylist()
    return {r["id"]: r for r in manifest}, out


def test_resume_refuses_inputs_replaced_under_the_same_path(tiny_model, tmp_path):
    import os

    from fleetgen.errors import ConfigError
    from fleetgen.jobs.inputs import check_unchanged
    from fleetgen.workers.output.storage import Output

    (tmp_path / "a.png").write_bytes(png("red"))
    (tmp_path / "b.png").write_bytes(png("blue"))
    rows = {"id": ["a", "b"], "prompt": ["a photo"] * 2, "input_image": ["a.png", "b.png"]}
    _, out = run(tiny_model, tmp_path, rows, "image-to-image", strength=0.5)
    output = Output(str(out))
    assert check_unchanged(output, ["shard-00000"]) == 2
    stat = os.stat(tmp_path / "a.png")
    os.utime(tmp_path / "a.png", (stat.st_atime + 60, stat.st_mtime + 60))  # touched: same bytes
    assert check_unchanged(output, ["shard-00000"]) == 2
    (tmp_path / "a.png").write_bytes(png("green"))  # replaced under the same path
    with pytest.raises(ConfigError, match=r"1 input image\(s\) changed .*a\.png.*--overwrite"):
        check_unchanged(output, ["shard-00000"])
    (tmp_path / "a.png").write_bytes(png("red"))
    (tmp_path / "b.png").unlink()
    said = []
    assert check_unchanged(output, ["shard-00000"], say=said.append) == 2
    assert "1 input image(s) of committed shards are gone" in said[0]

"""A resumed image-input job checks its inputs are still the bytes its images were made from (jobs/inputs.py)."""

from __future__ import annotations

import pytest

from tests.conftest import png
from tests.workers.rows.test_inputs import run


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

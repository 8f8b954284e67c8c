"""The rooms the next capabilities land in, used as a new one would use them: a throw-away output
format (tests/plugins/throwaway.py) added through the registry only, round-tripped through a job,
`verify` and `status`."""

import io
import json

import pytest

from jobs.cli import main
from jobs.config import JobConfig, validate
from jobs.driver import run_job
from tests.conftest import FAST, write_prompts
from workers.formats import FORMATS, PLUGINS_ENV


@pytest.fixture
def plugins(monkeypatch):
    monkeypatch.setenv(PLUGINS_ENV, "tests.plugins.throwaway")
    yield
    FORMATS.pop("jsonl", None)


def test_a_format_added_through_the_registry_round_trips(ray_cluster, tiny_model, tmp_path, capsys, plugins):
    prompts = write_prompts(tmp_path / "p.parquet", [f"a lantern {i}" for i in range(5)] + [None],
                            id=[f"r{i}" for i in range(6)], label=[f"l{i}" for i in range(6)])
    out = tmp_path / "out"
    config = validate(JobConfig(input=str(prompts), output=str(out), model=tiny_model, rows_per_shard=3, workers=1,
                                output_format="jsonl", **FAST))
    summary = run_job(config, progress_stream=io.StringIO())
    assert summary.complete and summary.images_ok == 5 and summary.images_error == 1
    assert sorted(p.name for p in (out / "lines").iterdir()) == ["shard-00000.jsonl", "shard-00001.jsonl"]
    lines = [json.loads(line) for p in sorted((out / "lines").iterdir()) for line in p.read_text().splitlines()]
    assert [(line["id"], line["label"]) for line in lines] == [(f"r{i}", f"l{i}") for i in range(5)]
    assert "Each line of" in (out / "README.md").read_text()  # the card's words are the format's

    assert main(["verify", "--deep", str(out)]) == 0
    assert "5 images" in capsys.readouterr().out
    assert main(["status", str(out)]) == 0
    assert "shards 2/2 committed, rows 6/6: 5 images, 1 row errors" in capsys.readouterr().out

    # damage read back by the format's own reader: one image's bytes changed
    path = out / "lines" / "shard-00001.jsonl"
    first, *rest = path.read_text().splitlines()
    line = json.loads(first)
    line["b64"] = line["b64"][:-8] + "AAAAAAA="
    path.write_text("\n".join([json.dumps(line), *rest]) + "\n")
    assert main(["verify", "--deep", str(out)]) == 1
    assert "mismatch" in capsys.readouterr().out
    assert main(["verify", "--fix", str(out)]) == 1  # un-commits the shard ...
    capsys.readouterr()
    assert not path.exists()
    again = run_job(config, progress_stream=io.StringIO())  # ... and a rerun makes it again
    assert again.complete and again.shards_skipped == 1
    assert main(["verify", "--deep", str(out)]) == 0

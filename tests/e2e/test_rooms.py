"""The rooms the next capabilities land in, used as a new one would use them: a throw-away per-row
setting and a throw-away output format (tests/plugins/throwaway.py), each one entry (the field
table, the format registry), round-tripped through a job, `verify` and `status` as a user runs
them (commands in processes of their own, `FLEETGEN_PLUGINS` naming the module)."""

import base64
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.conftest import run_args, write_prompts

ROOT = Path(__file__).resolve().parents[2]


def _fleetgen(*args: str, ray_address: str | None = None) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "FLEETGEN_PLUGINS": "tests.plugins.throwaway",
        **({"RAY_ADDRESS": ray_address} if ray_address else {}),
    }
    return subprocess.run(
        [sys.executable, "-m", "fleetgen", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


def _lines(out: Path) -> dict[str, dict]:
    return {
        line["id"]: line
        for p in sorted((out / "lines").iterdir())
        for line in map(json.loads, p.read_text().splitlines())
    }


def test_a_setting_and_a_format_added_as_one_entry_each_round_trip(ray_address, tiny_model, tmp_path):
    # Three rows alike but for `guidance_rescale` (none, 0, 0.7), one out of its range, one without a prompt.
    prompts = write_prompts(
        tmp_path / "p.parquet",
        ["a lantern"] * 4 + [None],
        id=["none", "zero", "some", "bad", "np"],
        seed=[7] * 5,
        guidance_rescale=[None, 0.0, 0.7, 3.0, None],
        label=list("abcde"),
    )
    out = tmp_path / "out"
    run = [
        "run",
        *run_args(
            str(prompts), str(out), tiny_model, rows_per_shard="3", max_batch="1", workers="1", output_format="jsonl"
        ),
    ]
    done = _fleetgen(*run, ray_address=ray_address)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "per-row settings: guidance_rescale ← `guidance_rescale`" in done.stderr

    # the setting: checked per row, recorded per image, stored beside it, and it reached the pipeline
    rows = {r["id"]: r for r in pq.read_table(out / "shards").to_pylist()}
    assert rows["bad"]["status"] == "error" and rows["bad"]["error"] == "guidance_rescale `3.0` is out of range [0, 1]"
    assert [rows[i]["guidance_rescale"] for i in ("none", "zero", "some")] == [None, 0.0, pytest.approx(0.7)]
    lines = _lines(out)
    assert sorted(lines) == ["none", "some", "zero"] and lines["some"]["label"] == "c"
    assert lines["some"]["guidance_rescale"] == pytest.approx(0.7) and lines["none"]["guidance_rescale"] is None
    digest = {i: hashlib.sha256(base64.b64decode(lines[i]["b64"])).hexdigest() for i in lines}
    assert digest == {i: rows[i]["sha256"] for i in lines}
    assert digest["none"] == digest["zero"] != digest["some"]  # 0 is the pipeline's default; 0.7 changes pixels
    job = json.loads((out / "job.json").read_text())
    assert job["fingerprint"]["columns"]["guidance_rescale"] == "guidance_rescale"  # the column is in the fingerprint
    assert "Each line of" in (out / "README.md").read_text()  # the card's words are the format's

    # the format's read-back serves verify and status
    verified = _fleetgen("verify", "--deep", str(out))
    assert verified.returncode == 0 and "3 images" in verified.stdout, verified.stdout + verified.stderr[-2000:]
    status = _fleetgen("status", str(out))
    assert status.returncode == 0, status.stderr[-2000:]
    assert "shards 2/2 committed, rows 5/5: 3 images, 2 row errors" in status.stdout

    # damage found by the format's own reader; --fix un-commits the shard and a rerun makes it again
    path = out / "lines" / "shard-00000.jsonl"
    first, *rest = path.read_text().splitlines()
    line = json.loads(first)
    line["b64"] = base64.b64encode(b"not the image").decode()
    path.write_text("\n".join([json.dumps(line), *rest]) + "\n")
    damaged = _fleetgen("verify", "--deep", str(out))
    assert damaged.returncode == 1 and "mismatch" in damaged.stdout, damaged.stdout
    assert _fleetgen("verify", "--fix", str(out)).returncode == 1 and not path.exists()
    again = _fleetgen(*run, ray_address=ray_address)
    assert again.returncode == 0 and "resuming: 1 of 2 shards already committed" in again.stderr, again.stderr[-3000:]
    assert {i: hashlib.sha256(base64.b64decode(v["b64"])).hexdigest() for i, v in _lines(out).items()} == digest
    assert _fleetgen("verify", "--deep", str(out)).returncode == 0

"""A setting is declared once: one field with its `setting(...)` in the record that carries it
(fleetgen/settings.py). This test adds one — a line written into a copy of the source, as a
developer would write it — and finds it everywhere the table reaches: `fleetgen run`'s options and
`--help`, `JobConfig`, a TOML file (typed), `fleetgen.run`'s keywords (a misspelling answered with
it), job.json's fingerprint where it is the job's, and docs/reference/options.md."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# (record's module, the line after which the new field goes, the field, where it lands in a job)
CASES = {
    "a pixel setting, the job's": (
        "workers/spec.py",
        '    crf: int = setting(18, "video tasks: the encoder\'s quality, 0 (lossless) to 51; lower is larger")\n',
        '    sharpness: float = setting(0.0, "how sharp every image is (a test\'s setting)")\n',
        "generation",
    ),
    "a worker's own": (
        "workers/spec.py",
        '        4, "images per pipeline call, at most (each worker sizes its own batch up to it)", at_least=1, plan=True\n    )\n',
        '    sharpness: float = setting(0.0, "how sharp each worker makes its images (a test\'s setting)")\n',
        "fit",
    ),
}

CHECK = """
import json, sys, tomllib
from pathlib import Path

import fleetgen
from fleetgen.cli import _parser
from fleetgen.errors import ConfigError, FleetgenError
from fleetgen.jobs.config import make_config
from fleetgen.jobs.reference import options_page

where = sys.argv[1]
out = {}
args = _parser().parse_args(["run", "--sharpness", "0.5"])
out["cli"] = args.sharpness
run = _parser()._subparsers._group_actions[0].choices["run"]
out["help"] = "how sharp" in run.format_help()
base = {"input": "in.parquet", "output": "out", "model": "org/model"}
config = make_config({**base, "sharpness": 0.5})
out["config"] = getattr(getattr(config, where), "sharpness")
out["record"] = config.to_dict()["sharpness"]
out["fingerprint"] = "sharpness" in config.generation.record()
Path("job.toml").write_text("sharpness = 2\\n")
out["toml"] = getattr(getattr(make_config(base, "job.toml"), where), "sharpness")
Path("job.toml").write_text('sharpness = "very"\\n')
try:
    make_config(base, "job.toml")
except ConfigError as err:
    out["toml_error"] = str(err)
try:
    fleetgen.run("missing.parquet", "out", "org/model", sharpnes=1.0)
except ConfigError as err:
    out["misspelt"] = str(err)
try:
    fleetgen.run("missing.parquet", "out", "org/model", sharpness=1.0)
except FleetgenError as err:
    out["accepted"] = type(err).__name__ + ": " + str(err)
out["docs"] = [line for line in options_page().splitlines() if "--sharpness" in line]
print(json.dumps(out))
"""


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_setting_added_as_one_field_reaches_every_surface(case, tmp_path):
    module, after, line, where = CASES[case]
    tree = tmp_path / "tree"
    for room in ("fleetgen", "jobs", "workers", "offload", "cluster"):
        shutil.copytree(ROOT / room, tree / room, ignore=shutil.ignore_patterns("__pycache__"))
    source = (tree / module).read_text()
    assert source.count(after) == 1, f"{module} no longer has the line the field goes after"
    (tree / module).write_text(source.replace(after, after + line))

    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CHECK), where],
        cwd=tree,  # `import fleetgen` finds the copy first, and the copy its own rooms
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert (seen["cli"], seen["help"], seen["config"], seen["record"], seen["toml"]) == (0.5, True, 0.5, 0.5, 2.0)
    assert seen["toml_error"] == "`sharpness` in job.toml must be float, got `'very'`."
    assert seen["misspelt"] == "`fleetgen.run` has no option `sharpnes`. Did you mean `sharpness`?"
    assert seen["accepted"].startswith("InputError:") and "missing.parquet" in seen["accepted"]
    # the job's setting is in its fingerprint; a worker's own is not
    assert seen["fingerprint"] is (where == "generation")
    scope, fingerprint = ("job", "yes") if where == "generation" else ("worker", "")
    meaning = line.split('"')[1]
    assert seen["docs"] == [f"| `--sharpness` | number | `0.0` | {scope} | {fingerprint} | {meaning} |"]


def test_the_copy_is_the_code_that_runs(tmp_path):
    """The check above runs the copy, not the installed tree: a copy without the field knows no such option."""
    tree = tmp_path / "tree"
    for room in ("fleetgen", "jobs", "workers", "offload", "cluster"):
        shutil.copytree(ROOT / room, tree / room, ignore=shutil.ignore_patterns("__pycache__"))
    (tree / "fleetgen" / "settings.py").write_text((tree / "fleetgen" / "settings.py").read_text() + "\nCOPY = True\n")
    done = subprocess.run(
        [sys.executable, "-c", "import fleetgen.settings as s, fleetgen.jobs.config as c; print(s.COPY, c.__file__)"],
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[0] == "True" and done.stdout.split()[1].startswith(str(tree))

"""The Python API (fleetgen/api.py) from a plain Python process, as a notebook or a script uses it:
the same records, errors and defaults as the commands, and `import fleetgen` loading no torch."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
    )


def test_import_fleetgen_loads_no_framework(tmp_path):
    done = _python(
        """
        import sys, fleetgen
        print(sorted(m for m in ("torch", "ray", "diffusers", "transformers", "pyarrow") if m in sys.modules))
        assert callable(fleetgen.run) and callable(fleetgen.plan) and fleetgen.__version__
        """,
        tmp_path,
    )
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


def test_bad_options_are_the_commands_errors(tmp_path):
    import fleetgen

    with pytest.raises(
        fleetgen.ConfigError, match="`fleetgen.run` has no option `max_bacth`. Did you mean `max_batch`"
    ):
        fleetgen.run("in.parquet", "out", "org/model", max_bacth=8)
    with pytest.raises(fleetgen.ConfigError, match="`--cache` must be none, first-block"):
        fleetgen.run("in.parquet", "out", "org/model", cache="fast")
    with pytest.raises(fleetgen.ConfigError, match="`fleetgen.plan` has no option `gpu_type`"):
        fleetgen.plan("sdxl", "24GiB", gpu_type="x")
    with pytest.raises(fleetgen.ConfigError, match="`--gpu x` is not a GPU fleetgen knows"):
        fleetgen.plan("sdxl", "24GiB", gpu="x")
    with pytest.raises(fleetgen.FleetgenError, match="holds no fleetgen job"):
        fleetgen.status(str(tmp_path))


def test_plan_is_the_commands_plan(capsys):
    import json

    import fleetgen
    from fleetgen.cli import main

    plans = fleetgen.plan("sdxl", ["8GiB", "80GiB"], host_memory="64GiB", width=1024, height=1024)
    assert [r["gpu_memory"] for r in plans.rows] == ["8GiB", "80GiB"] and plans.all_fit
    assert main(["plan", "--model", "sdxl", "--gpu-memory", "8GiB", "--gpu-memory", "80GiB",
                 "--host-memory", "64GiB", "--width", "1024", "--height", "1024", "--json"]) == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out) == plans.to_dict()


@pytest.mark.ray
def test_run_status_verify_report_from_a_script(tiny_model, tmp_path, ray_address):
    """The README's Python example, with the session's Ray (as RAY_ADDRESS would name a cluster)."""
    from tests.conftest import write_prompts

    write_prompts(tmp_path / "prompts.parquet", ["a red fox", "an owl at night"] * 2)
    done = _python(
        f"""
        import fleetgen
        summary = fleetgen.run("prompts.parquet", "out/first", {tiny_model!r}, width=64, height=64, steps=2,
                               device="cpu", workers=1)
        state, report = fleetgen.status("out/first"), fleetgen.verify("out/first", deep=True)
        print(summary.images_ok, summary.complete, summary.exit_code, state.complete, state.images_ok, report.clean)
        print(fleetgen.report("out/first"))
        with fleetgen.warm_workers() as warm:  # two more runs, the second in the first one's worker
            runs = [fleetgen.run("prompts.parquet", f"out/{{n}}", {tiny_model!r}, width=64, height=64, steps=n,
                                 device="cpu", workers=1) for n in (2, 3)]
        print(warm.reused, [r.images_ok for r in runs], [w["worker"] for r in runs for w in r.workers])
        import sys
        print("torch" in sys.modules, "diffusers" in sys.modules)  # the workers run them; the driver never imports them
        """,
        tmp_path,
        {"RAY_ADDRESS": ray_address},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    first, second, warm, imported = done.stdout.strip().splitlines()[-4:]
    assert imported == "False False"
    assert first == "4 True 0 True 4 True" and second.endswith("report.html")
    assert warm == "1 [4, 4] ['w0', 'w0']"

"""`fleetgen plan` on every family's directory and with storage formats (the CLI over jobs/planning.py)."""

import json

import pytest

from fleetgen.workers.families.detect import FAMILIES


@pytest.fixture(scope="module")
def models(family_models):
    return family_models


def test_plan_counts_float8_bytes_and_loads_at_the_run_dtype(capsys):
    from fleetgen.jobs.cli import main

    args = ["plan", "--model", "flux.2-dev", "--gpu-memory", "24GiB", "--host-memory", "128GiB", "--json"]
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*args, "--quantize", "transformer=fp8"]) == 0
    fp8 = json.loads(capsys.readouterr().out)
    transformer = fp8["components"]["transformer"]
    ratio = transformer["bytes_as"]["fp8"] / transformer["bytes"]
    assert 0.5 <= ratio < 0.51 and fp8["quantize"] == "transformer=fp8"
    assert fp8["plans"][0]["formats"] == {"transformer": "fp8"}
    assert fp8["plans"][0]["load_host_bytes"] == plain["load_host_bytes"]  # loaded in bf16, cast after
    assert fp8["components"]["text_encoder"] == plain["components"]["text_encoder"]


@pytest.mark.parametrize("family", ["sdxl", "sd3", "flux", "pixart-sigma", "sana"])
def test_plan_works_on_every_family_directory(family, models, capsys):
    from fleetgen.jobs.cli import main

    assert (
        main(
            [
                "plan",
                "--model",
                models[family],
                "--gpu-memory",
                "1GiB",
                "--width",
                "64",
                "--height",
                "64",
                "--host-memory",
                "1GiB",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["family"] == family and out["dtype"] == FAMILIES[family].dtype and "error" not in out["plans"][0]

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


def test_plan_for_a_named_gpu_takes_its_memory_throughput_and_link(capsys):
    """`--gpu H100`: the card's memory is the budget, its throughput and link the plan's figures
    (offload/devices.py), so a transformer streamed every step predicts a real slowdown there, where
    the old defaults (100 TFLOP/s, 20 GB/s) predicted nearly none; `--gpu-memory` still sets the budget."""
    from fleetgen.jobs.cli import main
    from fleetgen.offload.devices import COMPUTE_EFFICIENCY, GPUS

    base = ["plan", "--model", "flux.1-dev", "--steps", "50", "--max-batch", "1", "--host-memory", "128GiB", "--json"]
    assert main([*base, "--gpu", "h100-sxm"]) == 0
    card = json.loads(capsys.readouterr().out)
    assert card["gpu"] == "H100" and [r["gpu_memory"] for r in card["plans"]] == ["80GiB"]
    assert card["flops"] == GPUS["H100"].bf16_tflops * 1e12 * COMPUTE_EFFICIENCY
    assert card["bandwidth_bytes_per_s"] == GPUS["H100"].bandwidth
    resident = card["plans"][0]["predicted_seconds_per_image"]
    assert 8 < resident < 13  # published: 12 s (HF blog) and 9.3 s (cache-dit) on an H100 (BENCHMARKS.md)
    assert main([*base, "--gpu", "H100", "--gpu-memory", "16GiB"]) == 0
    small = json.loads(capsys.readouterr().out)["plans"][0]
    assert small["modes"]["transformer"].startswith(("leaf_level", "block_level"))
    assert small["predicted_relative_speed"] < 0.6  # streaming 22 GiB a step over PCIe costs on a fast card
    assert main([*base, "--gpu-memory", "16GiB"]) == 0
    default = json.loads(capsys.readouterr().out)
    assert default["gpu"] is None and default["plans"][0]["predicted_relative_speed"] > 0.85


def test_an_unknown_gpu_or_no_budget_is_one_line_with_exit_2(capsys):
    from fleetgen.jobs.cli import main

    assert main(["plan", "--model", "flux.1-dev", "--gpu", "H1OO"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "`--gpu H1OO` is not a GPU fleetgen knows" in err and "Did you mean H100" in err, err
    assert main(["plan", "--model", "flux.1-dev"]) == 2
    assert "Give `--gpu-memory`" in capsys.readouterr().err


def test_scorers_are_planned_beside_the_pipeline():
    """`fleetgen plan --score`: the scorers' bytes come off each budget, as a worker plans; the summary says
    what they hold and cost."""
    import fleetgen

    alone = fleetgen.plan("flux.1-dev", ["24GiB"], host_memory="64GiB", gpu="H100")
    scored = fleetgen.plan("flux.1-dev", ["24GiB"], host_memory="64GiB", gpu="H100", score="clip,pickscore")
    held = scored.summary["scorers"]["bytes"]
    assert held == int((428_000_000 + 986_000_000) * 2 * 1.25) and alone.summary["scorers"] is None
    assert scored.rows[0]["budget_bytes"] == alone.rows[0]["budget_bytes"] - held
    assert "scorers clip, pickscore: 3.3 GiB held on the device" in scored.text()

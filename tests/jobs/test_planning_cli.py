"""`fleetgen plan` on every family's directory and with storage formats (the CLI over jobs/planning.py)."""

import json

import pytest

from fleetgen.workers.families.detect import FAMILIES


@pytest.fixture(scope="module")
def models(family_models):
    return family_models


def test_plan_counts_float8_bytes_and_loads_at_the_run_dtype(capsys):
    from fleetgen.cli import main

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
    from fleetgen.cli import main

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
    from fleetgen.cli import main
    from fleetgen.offload.devices import GPUS, MATMUL_SHARE

    base = ["plan", "--model", "flux.1-dev", "--steps", "50", "--max-batch", "1", "--host-memory", "128GiB", "--json"]
    assert main([*base, "--gpu", "h100-sxm"]) == 0
    card = json.loads(capsys.readouterr().out)
    assert card["gpu"] == "H100" and [r["gpu_memory"] for r in card["plans"]] == ["80GiB"]
    assert card["flops"] == GPUS["H100"].bf16_tflops * 1e12 * MATMUL_SHARE
    assert card["bandwidth_bytes_per_s"] == GPUS["H100"].bandwidth
    resident = card["plans"][0]["predicted_seconds_per_image"]
    assert 8 < resident < 13  # published: 12 s (HF blog) and 9.3 s (cache-dit) on an H100 (BENCHMARKS.md)
    assert main([*base, "--gpu", "H100", "--gpu-memory", "16GiB"]) == 0
    small = json.loads(capsys.readouterr().out)["plans"][0]
    assert small["modes"]["transformer"].startswith(("leaf_level", "block_level"))
    assert small["predicted_relative_speed"] < 0.6  # streaming 22 GiB a step over PCIe costs on a fast card
    assert main([*base, "--gpu-memory", "16GiB"]) == 0
    default = json.loads(capsys.readouterr().out)
    # the defaults' slow compute hides more of the same transfers
    assert (
        default["gpu"] is None and default["plans"][0]["predicted_relative_speed"] > small["predicted_relative_speed"]
    )


def test_an_unknown_gpu_or_no_budget_is_one_line_with_exit_2(capsys):
    from fleetgen.cli import main

    assert main(["plan", "--model", "flux.1-dev", "--gpu", "H1OO"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "`--gpu H1OO` is not a GPU fleetgen knows" in err and "Did you mean H100" in err, err
    assert main(["plan", "--model", "flux.1-dev"]) == 2
    assert "Give `--gpu-memory`" in capsys.readouterr().err


def test_scorers_are_planned_beside_the_pipeline():
    """`fleetgen plan --score`: per batch the scorers' bytes come off the budget (they are resident beside
    the pipeline, as on a worker); phased with a decode phase they are a phase of their own after it, so
    no phase gives anything up; the summary says what they hold and cost."""
    import fleetgen

    def at(phases: str, score: str | None):
        kw = {"score": score} if score else {}
        return fleetgen.plan("flux.1-dev", ["24GiB"], host_memory="64GiB", gpu="H100", phases=phases, **kw)

    alone, scored = at("off", None), at("off", "clip,pickscore")
    held = scored.summary["scorers"]["bytes"]
    assert held == int((428_000_000 + 986_000_000) * 2 * 1.25) and alone.summary["scorers"] is None
    a, s = alone.rows[0], scored.rows[0]
    assert a["budget_bytes"] == s["budget_bytes"] == 24 * 2**30  # the whole card's, as a leaner plan steps down from
    assert s["batch_size"] < a["batch_size"] and s["peak_bytes"] <= (24 * 2**30 - held) * 0.9
    assert f"the scorers hold {held / 2**30:.1f} GiB beside the pipeline" in s["reason"]
    assert "scorers clip, pickscore: 3.3 GiB on the device once the pipeline has decoded" in scored.text()

    phased, phased_scored = at("on", None).rows[0], at("on", "clip,pickscore").rows[0]
    assert len(phased_scored["phases"]) == 3 and phased_scored["batch_size"] == phased["batch_size"]
    assert phased_scored["peak_bytes"] == phased["peak_bytes"]
    assert "then the scorers (3.3 GiB) alone on the device score the chunk" in phased_scored["reason"]
    # their moves, twice per chunk over the host link, are the only cost phased
    extra = phased_scored["predicted_seconds_per_image"] - phased["predicted_seconds_per_image"]
    assert 0 < extra < 0.001  # 6.5 GiB over a ~50 GB/s link per 256 images: about 0.5 ms per image


def test_a_node_of_eight_holds_flux2_dev_once(capsys):
    """FLUX.2 dev (105 GiB of bf16 weights) on a node of 8 x 24 GB with 512 GiB of RAM: with a copy per
    worker each worker's share (64 GiB) cannot even load it; with the node's one copy every worker streams
    both large components from it, the node holds the weights once, and each worker's share of the host
    link is the node's over 8. One worker on a 128 GiB host cannot write the node's copy beside its load,
    and plans as a copy of its own, saying so."""
    import fleetgen
    from fleetgen.cli import main
    from fleetgen.jobs.planning import NODE_HOST_BANDWIDTH

    node = fleetgen.plan("flux.2-dev", "24GiB", gpu="H100", host_memory="512GiB", workers_per_node=8)
    row = node.rows[0]
    assert "error" not in row, row
    assert row["modes"]["transformer"].endswith("+stream") and row["modes"]["text_encoder"].endswith("+stream")
    shared = node.to_dict()["components"]
    weights = sum(c["bytes"] for c in shared.values())
    n = row["node"]
    assert (n["workers"], n["host_copy"], n["shared_bytes"]) == (8, "node", weights)
    assert n["host_bytes"] == weights + 8 * row["host_bytes"] <= 512 * 2**30
    assert n["load_peak_bytes"] == weights + shared["transformer"]["bytes"]  # the first writes; the largest in flight
    assert n["bandwidth_per_worker"] == pytest.approx(NODE_HOST_BANDWIDTH / 8)
    assert "stream from the node's shared copy" in row["reason"]

    own = fleetgen.plan("flux.2-dev", "24GiB", gpu="H100", host_memory="512GiB", workers_per_node=8, host_copy="worker")
    assert own.rows[0]["error"].startswith("Nothing loads (host RAM binds)")
    assert "512.0 GiB on the node / 8 workers; `--host-copy node` holds the weights once" in own.rows[0]["error"]

    assert (
        main(
            [
                "plan",
                "--model",
                "flux.2-dev",
                "--gpu-memory",
                "24GiB",
                "--host-memory",
                "512GiB",
                "--workers-per-node",
                "8",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert (
        "a node of 8 worker(s), host copy per node: host RAM 104.9 GiB (the node's copy of the weights, once)" in text
    )

    alone = fleetgen.plan("flux.2-dev", "24GiB", gpu="H100", host_memory="128GiB").rows[0]
    assert (
        alone["node"]["host_copy"] == "worker" and "a copy per worker: writing the node's copy" in alone["node"]["note"]
    )
    assert main(["plan", "--model", "flux.2-dev", "--gpu-memory", "24GiB", "--workers-per-node", "0"]) == 2

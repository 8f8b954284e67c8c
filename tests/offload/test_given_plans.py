"""Any plan predicted (`plan(..., given=, batch=)`, `fleetgen plan --placement --batch --phases`), its
terms, the candidates a worker times, and the stored speed fit (offload/speed.json) against the rows
it was fitted on."""

import json
from dataclasses import replace

import pytest

from fleetgen.errors import OffloadError
from fleetgen.offload import DeviceSpec, plan
from fleetgen.offload.cost import Placement
from fleetgen.offload.planner import candidates
from fleetgen.offload.speed import STORED, Speed

GIB = 2**30
H200 = {"bandwidth": 50.4e9, "flops": 791e12}


def context(model: str, steps: int = 6, max_batch: int = 4, phases: str = "auto"):
    from fleetgen.jobs.planning import pipeline_profile, plan_workload

    work, family = plan_workload(model, steps=steps, width=1024, height=1024, max_batch=max_batch, phases=phases)
    return pipeline_profile(model, family.dtype, family.upcasts_vae, ()), work


@pytest.mark.parametrize("model", ["flux.1-dev", "sdxl", "z-image-turbo"])
@pytest.mark.parametrize("budget", [8, 16, 24])
def test_the_planners_own_choice_replays_as_given(model, budget):
    """A plan the planner chose, given back with its placements, batch and phases, predicts the same:
    how a measured row (its `modes` and `batch`) is set beside today's model."""
    prof, work = context(model)
    device = DeviceSpec(budget * GIB, 96 * GIB, **H200)
    chosen = plan(prof, device, work)
    given = {n: Placement.parse(m) for n, m in chosen.modes.items()}
    again = plan(prof, device, replace(work, phases="on" if chosen.phases else "off"), given, chosen.batch_size)
    assert (again.modes, again.batch_size, again.phases) == (chosen.modes, chosen.batch_size, chosen.phases)
    assert again.seconds_per_image == pytest.approx(chosen.seconds_per_image)
    assert again.peak_bytes == chosen.peak_bytes
    # the terms add up to the prediction, per component and the call's own
    total = sum(t.seconds for t in again.terms.values())
    assert total == pytest.approx(again.seconds_per_image, rel=1e-6)
    assert set(again.terms) == {*prof.components, "pipeline"}


def test_streams_hide_transfers_behind_compute_and_blocking_copies_do_not():
    prof, work = context("flux.1-dev")
    device = DeviceSpec(24 * GIB, 96 * GIB, **H200)
    streamed = plan(prof, device, work, {"transformer": Placement("leaf", stream=True)}, 1).terms["transformer"]
    blocking = plan(prof, device, work, {"transformer": Placement("leaf")}, 1).terms["transformer"]
    assert streamed.transfer_hidden > 0 and blocking.transfer_hidden == 0
    assert streamed.compute == pytest.approx(blocking.compute)
    assert blocking.transfer_exposed > streamed.transfer_exposed
    assert blocking.transfer_exposed == pytest.approx(streamed.transfer_hidden + streamed.transfer_exposed)


def test_a_plan_that_does_not_fit_says_why_in_one_line():
    prof, work = context("flux.1-dev")
    device = DeviceSpec(16 * GIB, 96 * GIB, **H200)
    with pytest.raises(
        OffloadError, match=r"^does not fit \(device memory binds\): at batch 4 its predicted peak"
    ) as e:
        plan(prof, device, replace(work, phases="off"), {}, 4)
    assert "\n" not in str(e.value)
    with pytest.raises(OffloadError, match="does not fit \\(host RAM binds\\)"):
        plan(
            prof, replace(device, host_budget=8 * GIB), replace(work, phases="off"), {"transformer": Placement("leaf")}
        )
    with pytest.raises(OffloadError, match="no component transformr in flux.1-dev"):
        plan(prof, device, work, {"transformr": Placement("leaf")})
    with pytest.raises(OffloadError, match="leaf level on disk corrupts tied weights"):
        plan(prof, device, replace(work, phases="off"), {"transformer": Placement("leaf", disk=True)})


def test_candidates_are_distinct_fastest_first_and_hold_the_models_choice():
    prof, work = context("flux.1-dev")
    device = DeviceSpec(24 * GIB, 96 * GIB, **H200)
    best = plan(prof, device, replace(work, phases="off"))
    found = candidates(prof, device, replace(work, phases="off"), best, 3)
    assert best in found and len(found) == 3 and len({p.key for p in found}) == 3
    assert [p.cost_per_image for p in found] == sorted(p.cost_per_image for p in found)


def test_placements_read_as_records_spell_them():
    for label in ("resident", "leaf_level", "leaf_level+stream", "block_level(4)", "block_level(1)+disk"):
        assert Placement.parse(label).label == label
    for bad in ("leaf", "block_level", "block_level(0)", "resident+stream", "leaf_level+fast"):
        with pytest.raises(ValueError, match="is not a placement|neither streamed"):
            Placement.parse(bad)


def test_the_stored_fit_is_the_codes_and_meets_its_aims():
    """offload/speed.json: its constants predict each row it records as recorded (a change to the
    cost model without a refit fails here: `python bench/fit_speed.py --write`), and the fit meets the
    aims: 80 % of the rows within 0.77-1.3x, all within 0.5-2x."""
    from bench.fit_speed import measured_rows, predict, published_rows

    stored = json.loads(STORED.read_text())
    speed = Speed.of(stored["model"])
    rows = measured_rows() + published_rows()
    assert len(rows) == len(stored["rows"]) >= 19
    for row, kept in zip(rows, stored["rows"], strict=True):
        assert predict(row, speed) == pytest.approx(kept["predicted"], rel=1e-3), row["run"]
    ratios = [r["measured"] / predict(r, speed) for r in rows]
    assert sum(0.77 <= x <= 1.3 for x in ratios) >= 0.8 * len(ratios)
    assert all(0.5 <= x <= 2 for x in ratios)


def test_plan_cli_predicts_a_recorded_row_as_written(capsys):
    """A row of bench/results, its `modes` and `batch` typed as they are written, through the CLI."""
    from fleetgen.cli import main

    placement = "transformer=leaf_level+stream,text_encoder_2=leaf_level+stream"
    base = ["plan", "--model", "flux.1-dev", "--gpu", "H200", "--gpu-memory", "8GiB", "--host-memory", "96GiB"]
    args = [*base, "--steps", "6", "--placement", placement, "--batch", "2", "--phases", "off", "--json"]
    assert main(args) == 0
    row = json.loads(capsys.readouterr().out)["plans"][0]
    assert row["modes"]["transformer"] == "leaf_level+stream" and row["modes"]["vae"] == "resident"
    assert row["batch_size"] == 2 and row["predicted_seconds_per_image"] > 0
    terms = row["predicted_terms"]["transformer"]
    assert set(terms) == {"compute", "transfer_hidden", "transfer_exposed", "fixed", "seconds"}
    assert sum(t["seconds"] for t in row["predicted_terms"].values()) == pytest.approx(
        row["predicted_seconds_per_image"]
    )
    assert main([*base, "--placement", "transformer=resident", "--batch", "4"]) == 1
    out = capsys.readouterr().out
    assert "does not fit" in out and "8GiB: does not fit (device memory binds)" in out
    assert main([*base, "--placement", "transformer=leaf"]) == 2
    assert "`leaf` is not a placement" in capsys.readouterr().err

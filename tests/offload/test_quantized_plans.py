"""Quantization as a planned dimension, on the shipped architectures (meta weights): `auto` never
predicts slower than `none`, more memory (device or host) never predicts slower, the pruned search
agrees with the exhaustive product wherever that is small enough to run, and what the issue asks of
`fleetgen plan --model flux.2-dev --gpu-memory 24GiB --host-memory 64GiB`."""

import itertools
import json
from dataclasses import replace

import pytest
import torch

from fleetgen.errors import OffloadError
from fleetgen.offload import DeviceSpec, Workload, plan, profile_modules
from fleetgen.offload.architectures import NAMES
from fleetgen.offload.cost import MARGIN
from fleetgen.offload.planner import TIE  # plans within it compare as equal: the tie goes to fewer bytes moved
from fleetgen.offload.weight_formats import CHOOSABLE, FORMATS, parse_quantize, refusal
from tests.offload.exhaustive import exhaustive_key, plan_key

GIB = 1 << 30
BUDGETS = (8, 16, 24, 48, 80, 141)  # GiB of device memory: the cards a fleet mixes
HOSTS = (32, 64, 256)  # GiB of host RAM a worker may fill


@pytest.fixture(scope="module")
def profiles(meta_build):
    return {n: profile_modules(n, meta_build(n), torch.bfloat16, formats=CHOOSABLE) for n in NAMES}


def _plan(prof, gib, host, quantize, max_batch=4):
    work = Workload(width=1024, height=1024, steps=20, max_batch=max_batch, quantize=parse_quantize(quantize))
    try:
        return plan(prof, DeviceSpec(budget=gib * GIB, host_budget=host * GIB), work)
    except OffloadError:
        return None


@pytest.mark.slow
@pytest.mark.parametrize("arch", NAMES)
def test_auto_never_predicts_slower_and_more_memory_never_slows_it(arch, profiles):
    prof = profiles[arch]
    for host in HOSTS:
        last = None
        for gib in BUDGETS:
            none, auto = _plan(prof, gib, host, "none"), _plan(prof, gib, host, "auto")
            if none is not None:
                assert auto is not None and auto.seconds_per_image <= none.seconds_per_image * (1 + TIE), (gib, host)
            if auto is None:
                assert last is None, f"{arch}: {gib} GiB finds nothing although a smaller budget did"
                continue
            assert auto.peak_bytes <= gib * GIB * (1 - MARGIN) and auto.load_bytes <= host * GIB
            for name, fmt in auto.formats.items():  # every choice is one the table allows
                p = auto.placements[name]
                assert name in FORMATS[fmt].components and refusal(fmt, p.mode, p.stream, p.disk) is None
            # what the planner minimises: seconds, plus QUANTIZED_SHARE of the ideal per quantized component
            assert auto.seconds_per_image <= auto.cost_per_image
            if last is not None:
                assert auto.cost_per_image <= last.cost_per_image * (1 + TIE), (arch, gib, host)
            last = auto
    for gib in BUDGETS:  # more host RAM never predicts a higher cost either
        costs = [p.cost_per_image for p in (_plan(prof, gib, h, "auto") for h in HOSTS) if p is not None]
        assert all(b <= a * (1 + TIE) for a, b in zip(costs, costs[1:], strict=False)), (arch, gib, costs)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sd-1.5", "flux.2-dev", "qwen-image", "flux.1-dev"])
def test_auto_finds_what_the_exhaustive_search_finds(arch, profiles):
    prof = profiles[arch]
    # the per-batch search (phased plans are made of two of them: tests/offload/test_phasing.py)
    w = Workload(width=1024, height=1024, steps=20, max_batch=2, quantize=parse_quantize("auto"), phases="off")
    grid = [(16, 32), (24, 64), (48, 256)] if len(prof.components) > 3 else itertools.product(BUDGETS, HOSTS)
    for gib, host in grid:
        device = DeviceSpec(budget=gib * GIB, host_budget=host * GIB)
        expected = exhaustive_key(prof, device, w)
        try:
            got = plan(prof, device, w)
        except OffloadError:
            assert expected is None, (arch, gib, host)
            continue
        assert plan_key(got) == expected, (gib, host)


@pytest.mark.slow
def test_every_plan_of_auto_takes_under_a_second(profiles):
    import time

    worst = 0.0
    for arch in NAMES:
        for gib in (16, 24, 48):
            for host in (32, 64):
                started = time.perf_counter()
                _plan(profiles[arch], gib, host, "auto")
                worst = max(worst, time.perf_counter() - started)
    assert worst < 1.0, worst


@pytest.mark.slow
def test_flux2_dev_on_a_24_gib_card_with_64_gib_of_host_ram(capsys):
    """The issue's case: bf16 does not even load (105 GiB of weights); `auto` fits both budgets and
    says why; a mapping is the same on every worker and fixed."""
    from fleetgen.cli import main

    base = ["plan", "--model", "flux.2-dev", "--gpu-memory", "24GiB", "--host-memory", "64GiB", "--json"]
    assert main([*base, "--quantize", "none"]) == 1  # nothing fits: scripts see it
    none = json.loads(capsys.readouterr().out)["plans"][0]
    assert none["binds"] == ["host RAM"] and none["error"].startswith("Nothing loads (host RAM binds)")
    assert "`--quantize auto`" in none["error"]
    assert main([*base, "--quantize", "auto"]) == 0
    out = json.loads(capsys.readouterr().out)
    auto = out["plans"][0]
    assert "error" not in auto and auto["peak_bytes"] <= 24 * GIB * (1 - MARGIN)
    assert auto["load_host_bytes"] <= 64 * GIB and auto["host_bytes"] <= 64 * GIB
    assert auto["formats"]["transformer"] in ("nf4", "bnb-int8")  # only an at-load format lets it load
    assert auto["reason"].startswith("transformer nf4 resident") and "the only fit" in auto["reason"]
    bytes_as = out["components"]["transformer"]["bytes_as"]
    full = out["components"]["transformer"]["bytes"]  # bf16: one byte per weight is about half, nf4 under a third
    assert bytes_as["nf4"] < 0.3 * full and 0.49 * full < bytes_as["fp8"] < bytes_as["int8"] < 0.52 * full
    assert main([*base, "--quantize", "transformer=nf4,text_encoder=int8"]) == 0
    fixed = json.loads(capsys.readouterr().out)["plans"][0]
    assert fixed["formats"] == {"transformer": "nf4", "text_encoder": "int8"}
    assert fixed["reason"].startswith("transformer nf4 resident, text_encoder int8 block_level(")
    assert "(`--quantize text_encoder=int8,transformer=nf4`)" in fixed["reason"]
    # nf4 stays resident (bitsandbytes under group offloading is not verified): both nf4 do not fit
    assert main([*base, "--quantize", "transformer=nf4,text_encoder=nf4"]) == 1
    assert "Nothing fits 24.0 GiB" in json.loads(capsys.readouterr().out)["plans"][0]["error"]


@pytest.mark.slow
def test_a_worker_plans_only_what_it_can_apply_and_says_how_much_faster(profiles):
    """The issue's FLUX.1-dev worker: a 24 GiB card, 18 GiB of host RAM for offloaded copies, its
    pipeline loaded. Unquantized, the transformer streams from disk; with the formats it can apply
    after loading, `auto` holds an fp8 transformer resident and says by how much that is predicted
    faster. A component already holding a format keeps it; `none` quantizes nothing."""
    prof = profiles["flux.1-dev"]
    work = Workload(width=1024, height=1024, steps=20, max_batch=1, quantize=parse_quantize("auto"), loaded=True)
    device = DeviceSpec(budget=24 * GIB, host_budget=18 * GIB, formats=("fp8", "int8"))
    none = plan(prof, device, replace(work, quantize=parse_quantize("none")))
    assert none.placements["transformer"].disk and not none.formats
    got = plan(prof, device, work)
    assert got.formats["transformer"] == "fp8" and got.placements["transformer"].mode == "resident"
    assert set(got.formats.values()) <= {"fp8", "int8"}
    ratio = none.seconds_per_image / got.seconds_per_image
    assert ratio > 3
    assert f"{ratio:.2f}x the predicted images/s of the best unquantized plan" in got.reason
    assert got.reason.startswith("transformer fp8 resident")
    # with room for everything at the run dtype, nothing is quantized; nor for a few per cent of speed
    assert not plan(prof, DeviceSpec(budget=80 * GIB, host_budget=256 * GIB), work).formats
    assert not plan(prof, DeviceSpec(budget=24 * GIB, host_budget=64 * GIB), work).formats  # streams: ~free
    device = replace(device, formats=("fp8",))
    fixed = plan(prof, device, replace(work, fixed=(("text_encoder_2", "int8"),)))
    assert fixed.formats.get("text_encoder_2") == "int8"  # kept, though this device would not choose it
    assert not plan(prof, device, replace(work, quantize=parse_quantize("none"))).formats


@pytest.mark.slow
def test_a_worker_under_auto_plans_at_load_formats_before_reading_weights():
    """A CUDA worker with bitsandbytes, FLUX.2 dev on a 24 GiB card and 64 GiB of host RAM: planned
    from the configs on `meta` before loading, the transformer loads as nf4 (bf16 would not load);
    with 256 GiB of host RAM and an 80 GiB card it loads unquantized; without at-load formats, none."""
    from fleetgen.offload.architectures import resolve
    from fleetgen.workers.pipeline.plans import at_load_formats

    work = Workload(
        width=1024, height=1024, steps=28, cfg=False, max_batch=1, quantize=parse_quantize("auto"), loaded=True
    )
    root = str(resolve("flux.2-dev"))
    tight = DeviceSpec(budget=24 * GIB, host_budget=64 * GIB, formats=CHOOSABLE)
    assert at_load_formats(root, torch.bfloat16, tight, work, False) == {"transformer": "nf4"}
    roomy = DeviceSpec(budget=80 * GIB, host_budget=256 * GIB, formats=CHOOSABLE)
    assert at_load_formats(root, torch.bfloat16, roomy, work, False) == {}
    after_load_only = replace(tight, formats=("fp8", "int8"))
    assert at_load_formats(root, torch.bfloat16, after_load_only, work, False) == {}  # nothing loads: the worker says

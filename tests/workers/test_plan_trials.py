"""Plans chosen by measurement (`--plan-trials`, workers/pipeline/trials.py), on CPU with the tiny model.

A CPU worker told it has a GPU budget plans as a GPU worker would. Its device is made to contradict
the speed model: a forward pre-hook on the UNet sleeps in proportion to the batch it runs, so each
image costs more the larger its batch, where the model (fitted on GPUs) predicts the larger batch
faster. The trials must see it."""

import dataclasses
import json
import threading
import time

import pytest
import torch

from fleetgen.jobs.sharding import plan_shards, read_footer
from fleetgen.workers.pipeline.load import load_pipeline
from fleetgen.workers.rows.shard import Columns
from fleetgen.workers.spec import GenerationSettings, WorkerSpec
from fleetgen.workers.worker import Worker
from tests.conftest import write_prompts

BUDGET = 200 * 2**20  # all resident fits up to batch 4 at 64x64: the model ranks 4, 3, 2 first
SETTINGS = GenerationSettings(family="sd", task="text-to-image", steps=4, guidance=5.0, width=64, height=64, seed=0)
COLS = Columns.of("prompt", "id", None, None)


def slowed(model: str, per_sample: float = 0.004, oom_from: int | None = None):
    """The tiny pipeline on a device where every UNet sample costs `per_sample` seconds per sample in
    its batch (a batch of b, doubled by guidance, sleeps per_sample x (2b)^2 per step); from `oom_from`
    images per call on, the UNet runs out of memory as a GPU would."""
    pipe = load_pipeline(model, torch.float32, False)

    def hook(module, args, kwargs):
        samples = (args[0] if args else kwargs["sample"]).shape[0]
        if oom_from is not None and samples >= 2 * oom_from:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (emulated)")
        time.sleep(per_sample * samples * samples)

    pipe.unet.register_forward_pre_hook(hook, with_kwargs=True)
    return pipe


def worker(model, out, name="w0", pipe=None, **fit):
    # a long shard: the trials' cap (5 % of it) never cuts these tests short on a loaded machine, but the cap's own
    fit = {"max_batch": 4, "gpu_memory": BUDGET, "shard_images": 10_000, "plan_trials": "on", **fit}
    spec = WorkerSpec.of(name, model, str(out), SETTINGS, COLS, device="cpu", threads=1, **fit)
    return Worker(spec, pipe)


def plan_of(w: Worker) -> dict:
    return w.describe()["plan"]


def test_a_misled_model_keeps_the_plan_that_measured_fastest(tiny_model, tmp_path):
    w = worker(tiny_model, tmp_path, pipe=slowed(tiny_model, per_sample=0.01))
    plan = plan_of(w)
    trials = plan["trials"]
    assert plan["chosen_by"] == "measured"
    assert trials[0]["batch_size"] == 4  # the model's own choice, timed first
    assert [t["predicted_seconds_per_image"] for t in trials] == sorted(
        t["predicted_seconds_per_image"] for t in trials
    )
    fastest = min(trials, key=lambda t: t["measured_seconds_per_image"])
    # the device says so: each image costs more in a larger batch (0.32 s an image more at 4 than at 2; between 2
    # and 3, 0.16 s: a loaded machine's noise may pick either)
    assert fastest["batch_size"] < 4
    assert (plan["batch_size"], w.batch_size, plan["modes"]) == (fastest["batch_size"],) * 2 + (fastest["modes"],)
    assert plan["trial_seconds"] <= plan["cap_seconds"] + trials[0]["seconds"]
    w.close()


def test_trials_off_and_auto_keep_the_models_plan(tiny_model, tmp_path):
    off = worker(tiny_model, tmp_path / "a", pipe=slowed(tiny_model), plan_trials="off")
    assert plan_of(off)["chosen_by"] == "model" and plan_of(off)["batch_size"] == 4
    assert plan_of(off)["trials_skipped"] == "`--plan-trials off`"
    off.close()
    resident = worker(tiny_model, tmp_path / "b", gpu_memory=None)  # no budget: all resident, nothing to time
    assert plan_of(resident)["chosen_by"] == "model" and "without `--gpu-memory`" in plan_of(resident)["trials_skipped"]
    resident.close()


@pytest.mark.slow  # four workers, two of them at once (10 s): `make test`, not `make test-fast`
def test_one_trial_set_per_device_kind_and_a_rerun_measures_nothing(tiny_model, tmp_path):
    """Two workers of one kind starting together: one measures, the other waits for its answer; a
    third (the job run again on the same output) reuses it too, timing nothing."""
    made: dict = {}
    pipes = {n: slowed(tiny_model) for n in ("w0", "w1")}  # loaded one at a time: loading is not thread-safe

    def start(name):
        made[name] = worker(tiny_model, tmp_path, name=name, pipe=pipes[name])

    threads = [threading.Thread(target=start, args=(n,)) for n in ("w0", "w1")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    plans = {n: plan_of(w) for n, w in made.items()}
    assert sorted(p["chosen_by"] for p in plans.values()) == ["measured", "shared"]
    measured = next(n for n, p in plans.items() if p["chosen_by"] == "measured")
    shared = next(p for p in plans.values() if p["chosen_by"] == "shared")
    assert shared["measured_by"] == measured and shared["batch_size"] == plans[measured]["batch_size"]
    assert "trial_seconds" not in shared
    assert len(list((tmp_path / "plans").glob("*.json"))) == 1
    for w in made.values():
        w.close()
    again = worker(tiny_model, tmp_path, name="w2", pipe=slowed(tiny_model))
    assert plan_of(again)["chosen_by"] == "shared" and plan_of(again)["batch_size"] == plans[measured]["batch_size"]
    again.close()
    other = worker(tiny_model, tmp_path, name="w3", pipe=slowed(tiny_model), gpu_memory=2**30)
    assert plan_of(other)["chosen_by"] == "measured"  # another budget is another kind
    other.close()


def test_the_cap_holds(tiny_model, tmp_path):
    """A shard of a few images allows the model's own plan timed and nothing more."""
    w = worker(tiny_model, tmp_path, pipe=slowed(tiny_model), shard_images=2)
    plan = plan_of(w)
    assert len(plan["trials"]) == 1 and plan["cap_seconds"] < plan["trials"][0]["seconds"]
    assert plan["trials_cut"] == "2 of 3 left untimed by the cap (5% of a shard)"
    assert plan["batch_size"] == 4 and plan["chosen_by"] == "model"  # nothing else timed: the model's plan stays
    w.close()
    # its answer is written all the same: another worker of the kind does not wait for one that never comes
    started = time.monotonic()
    other = worker(tiny_model, tmp_path, name="w1", pipe=slowed(tiny_model), shard_images=2)
    assert plan_of(other)["chosen_by"] == "shared" and time.monotonic() - started < 30
    other.close()


def test_an_oom_in_a_trial_is_that_candidates_and_no_row_fails(tiny_model, tmp_path):
    w = worker(tiny_model, tmp_path, pipe=slowed(tiny_model, per_sample=0.0, oom_from=3))
    plan = plan_of(w)
    errors = {t["batch_size"]: t.get("error") for t in plan["trials"]}
    assert errors[4].startswith("out of memory") and errors[3].startswith("out of memory") and errors[2] is None
    assert plan["chosen_by"] == "measured" and plan["batch_size"] == 2
    path = write_prompts(tmp_path / "p.parquet", ["a", "b", "c", "d", "e"], id=list("abcde"))
    result = w.run_shard(plan_shards([read_footer(str(path))], 10)[0])
    assert (result.ok, result.errors) == (5, 0) and w.step_downs == []
    w.close()


@pytest.mark.slow  # two workers and two shards, the status and the report (5 s): `make test`
@pytest.mark.parametrize("trials", ["on"])
def test_pixels_are_those_without_trials(tiny_model, tmp_path, trials, capsys):
    path = write_prompts(tmp_path / "p.parquet", ["a red fox", "an owl", "the sea"], id=["x", "y", "z"])
    shard = plan_shards([read_footer(str(path))], 10)[0]
    timed = worker(tiny_model, tmp_path / "a", pipe=slowed(tiny_model, per_sample=0.01), plan_trials=trials)
    batch = plan_of(timed)["batch_size"]
    assert plan_of(timed)["chosen_by"] == "measured" and batch < 4
    plain = worker(tiny_model, tmp_path / "b", max_batch=batch, plan_trials="off")  # the same batch, untimed
    timed.run_shard(shard)
    plain.run_shard(shard)
    import pyarrow.parquet as pq

    def hashes(out):
        return pq.read_table(out / "shards" / f"{shard.id}.parquet").column("sha256").to_pylist()

    assert hashes(tmp_path / "a") == hashes(tmp_path / "b")
    record = json.loads((tmp_path / "a" / "workers" / "w0.json").read_text())
    assert record["plan"]["chosen_by"] == "measured" and record["stats"]["images"] == 3
    # `fleetgen status` and the report: per device kind, the plan kept, how, predicted beside measured
    from fleetgen.cli import main

    generation = {**dataclasses.asdict(SETTINGS), "rows_per_shard": 10}
    fingerprint = {"model": "m", "input": [{"rows": 3}], "generation": generation}
    (tmp_path / "a" / "job.json").write_text(json.dumps({"fingerprint": fingerprint, "shards_total": 1}))
    main(["status", str(tmp_path / "a")])
    text = capsys.readouterr().out
    kind = next(line for line in text.splitlines() if line.startswith("  cpu") and ", 0.2 GiB: all resident, " in line)
    assert "all resident batch 4: " in kind and "all resident batch 2: " in kind, kind
    assert f"batch {batch}; chosen by measured (" in kind and "predicted " in kind and ", measured " in kind, kind
    assert main(["report", str(tmp_path / "a")]) == 0
    page = (tmp_path / "a" / "report.html").read_text()
    assert "<h2>Plans by device kind</h2>" in page and "chosen by measured (" in page


def test_an_out_of_memory_step_down_takes_the_fastest_smaller_batch_measured(tiny_model, tmp_path, monkeypatch):
    """A device whose every UNet call costs a fixed 0.15 s: batch 4 measures fastest, then 3, then 2. Once
    the trials are done it runs out of memory at the kept batch: the worker steps down to the fastest smaller
    batch measured (3), not to half (2). The device's time is a clock its calls advance (the trials read it
    where they time a call): a loaded machine's stalls do not reorder what this test compares."""
    from fleetgen.workers.pipeline import fitted

    state = {"oom": False, "now": 0.0}
    pipe = load_pipeline(tiny_model, torch.float32, False)

    def hook(module, args, kwargs):
        samples = (args[0] if args else kwargs["sample"]).shape[0]
        if state["oom"] and samples >= state["oom"]:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (emulated)")
        state["now"] += 0.15

    class DeviceTime:  # the module `time` as fitted.py sees it, its perf_counter the device's clock
        def __getattr__(self, name):
            return getattr(time, name)

        @staticmethod
        def perf_counter():
            return state["now"]

    monkeypatch.setattr(fitted, "time", DeviceTime())
    pipe.unet.register_forward_pre_hook(hook, with_kwargs=True)
    w = worker(tiny_model, tmp_path, pipe=pipe)
    plan = plan_of(w)
    measured = {t["batch_size"]: t["measured_seconds_per_image"] for t in plan["trials"]}
    steps = SETTINGS.steps  # one UNet call a step (guidance doubles the batch, not the calls)
    assert measured == pytest.approx({b: 0.15 * steps / b for b in (4, 3, 2)}), plan["trials"]
    kept = plan["batch_size"]
    assert plan["chosen_by"] == "measured" and kept == 4, plan["trials"]
    state["oom"] = kept * 2  # out of memory at the kept batch (and above); classifier-free guidance doubles it
    path = write_prompts(tmp_path / "p.parquet", list("abcdef"), id=list("abcdef"))
    result = w.run_shard(plan_shards([read_footer(str(path))], 10)[0])
    assert (result.ok, result.errors) == (6, 0)
    assert w.step_downs[0]["to"] == "batch 3" and "fastest smaller batch measured" in w.step_downs[0]["reason"]
    w.close()

"""Hub models through the real `huggingface_hub` client, against a hub-shaped HTTP server on
loopback (tests/hub_server.py, via HF_ENDPOINT) serving a tiny pipeline at two revisions."""

import functools
import io
import json
import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from fleetgen.errors import ConfigError
from fleetgen.jobs.driver import run_job
from fleetgen.workers.tiny import write_tiny_model
from tests.conftest import HUB_PORT, make_job, write_prompts
from tests.hub_server import HubServer, Repo


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """The server on the port HF_ENDPOINT names (tests/conftest.py; the driver forwards it to the workers)."""
    with HubServer(port=HUB_PORT) as server:
        assert os.environ["HF_ENDPOINT"] == server.url
        yield server, tmp_path_factory.mktemp("hub")


def _repo(hub, root, name: str, gated: bool = False) -> Repo:
    """A repo on the server holding the tiny model; the test session downloads into its own cache (conftest)."""
    server, _ = hub
    repo = server.repos[name] = Repo(gated=gated)
    repo.push(write_tiny_model(root / name.replace("/", "--") / "v1", seed=0))
    return repo


_job = functools.partial(make_job, rows_per_shard=2, max_batch=2)


def _shas(out) -> dict:
    return {r["id"]: r["sha256"] for r in pq.read_table(out / "shards", columns=["id", "sha256"]).to_pylist()}


def _clip_repo(hub, name: str) -> Repo:
    """A repo on the server holding a tiny CLIP scorer (`--score clip=ORG/NAME`)."""
    from fleetgen.workers.tiny.scorers import write_tiny_scorer

    server, root = hub
    repo = server.repos[name] = Repo()
    repo.push(write_tiny_scorer(root / name.replace("/", "--") / "v1", "clip", seed=0))
    return repo


def _scores(out) -> dict:
    return {r["id"]: r["score_clip"] for r in pq.read_table(out / "shards", columns=["id", "score_clip"]).to_pylist()}


def test_the_pinned_commit_holds_across_a_resume_after_the_repo_moves_on(hub, ray_cluster, tmp_path):
    """The pipeline and a scorer's model, both on the hub, each pinned to its commit by the first run;
    both repos move on, and the shard redone by a rerun is made and scored by the first commits."""
    from fleetgen.workers.tiny.scorers import write_tiny_scorer

    server, root = hub
    repo, clip = _repo(hub, root, "org/tiny-pin"), _clip_repo(hub, "org/tiny-pin-clip")
    first, clip_first = repo.refs["main"], clip.refs["main"]
    prompts = write_prompts(tmp_path / "p.parquet", [f"pinned {i}" for i in range(4)], id=[f"r{i}" for i in range(4)])
    out = tmp_path / "out"
    job = functools.partial(_job, prompts, "org/tiny-pin", out, workers=1, score="clip=org/tiny-pin-clip")
    log = io.StringIO()
    assert run_job(job(), progress_stream=log).complete
    assert f"org/tiny-pin pinned to commit {first}" in log.getvalue()
    assert f"org/tiny-pin-clip pinned to commit {clip_first}" in log.getvalue()
    record = json.loads((out / "job.json").read_text())
    assert record["config"]["revision"] == first and record["fingerprint"]["model"] == f"org/tiny-pin@{first}"
    assert record["fingerprint"]["scorers"]["clip"] == {"model": f"org/tiny-pin-clip@{clip_first}", "weights": None}
    before, scores = _shas(out), _scores(out)

    # Both repos move on (other weights on main); a shard of the job is lost and the job rerun as it was.
    second = repo.push(write_tiny_model(root / "tiny-pin-v2", seed=7))
    clip_second = clip.push(write_tiny_scorer(root / "tiny-pin-clip-v2", "clip", seed=7))
    assert second != first and repo.refs["main"] == second and clip.refs["main"] == clip_second
    (out / "shards" / "shard-00001.parquet").unlink()
    (out / "_SUCCESS").unlink()
    log = io.StringIO()
    again = run_job(job(), progress_stream=log)
    assert again.complete and again.shards_skipped == 1
    assert f"using commit {first}, pinned in job.json" in log.getvalue()
    assert f"org/tiny-pin-clip: using commit {clip_first}, pinned by the first run" in log.getvalue()
    assert _shas(out) == before  # the redone shard was made with the first commit's weights
    assert _scores(out) == scores  # and scored by the first commit's CLIP (the second's scores differ)

    # The scorer's new commit asked for by name is another job.
    with pytest.raises(Exception, match="already holds a different job"):
        run_job(job(score=f"clip=org/tiny-pin-clip@{clip_second}"), progress_stream=io.StringIO())

    # Asking for the new commit explicitly is a different job.
    with pytest.raises(Exception, match="already holds a different job"):
        run_job(_job(prompts, "org/tiny-pin", out, workers=1, revision=second), progress_stream=io.StringIO())


def test_gated_and_missing_repos_fail_before_any_shard_runs(hub, tmp_path):
    _repo(hub, hub[1], "org/tiny-gated", gated=True)
    prompts = write_prompts(tmp_path / "p.parquet", ["a red fox"])
    with pytest.raises(ConfigError, match="`org/tiny-gated` is gated on the hub .* set HF_TOKEN"):
        run_job(_job(prompts, "org/tiny-gated", tmp_path / "gated"), progress_stream=io.StringIO())
    with pytest.raises(ConfigError, match="`org/no-such-model` was not found on the hub"):
        run_job(_job(prompts, "org/no-such-model", tmp_path / "missing"), progress_stream=io.StringIO())
    with pytest.raises(ConfigError, match="`--revision` `v9` does not exist in `org/tiny-gated`"):
        os.environ["HF_TOKEN"] = "hf_test_token"
        try:
            run_job(_job(prompts, "org/tiny-gated", tmp_path / "rev", revision="v9"), progress_stream=io.StringIO())
        finally:
            del os.environ["HF_TOKEN"]
    assert not (tmp_path / "gated").exists() and not (tmp_path / "missing").exists()


def test_two_workers_on_one_node_download_the_variant_files_once(hub, ray_cluster, tmp_path):
    """A repo with plain and fp16 weights, two workers on one node: `--variant fp16` downloads the fp16
    files only, each once (the workers share the node's cache), and the job's fingerprint says so."""
    server, root = hub
    both = root / "variant"
    write_tiny_model(both, seed=0)
    from fleetgen.workers.tiny import build_tiny_pipeline

    build_tiny_pipeline(seed=3).save_pretrained(both, variant="fp16")
    repo = server.repos["org/tiny-variant"] = Repo()
    repo.push(both)
    prompts = write_prompts(tmp_path / "p.parquet", [f"a variant {i}" for i in range(4)])
    assert run_job(
        _job(prompts, "org/tiny-variant", tmp_path / "out", workers=2, variant="fp16"), progress_stream=io.StringIO()
    ).complete
    fetched = {path: n for (name, _, path), n in server.downloads.items() if name == "org/tiny-variant"}
    weights = [p for p in repo.commits[repo.refs["main"]] if p.endswith(".fp16.safetensors")]
    assert weights and all(fetched.get(p) == 1 for p in weights), fetched
    assert "unet/diffusion_pytorch_model.fp16.safetensors" in fetched
    assert "unet/diffusion_pytorch_model.safetensors" not in fetched
    assert json.loads((tmp_path / "out" / "job.json").read_text())["fingerprint"]["model"].endswith("(variant fp16)")


@pytest.mark.slow
def test_a_hub_model_is_planned_from_its_configs_before_its_weights_are_fetched(hub, tmp_path):
    """`--quantize auto` on a worker that can apply formats at load (bitsandbytes on CUDA): a hub
    model's JSON files alone are fetched first and planned from (FLUX.2 dev's published configs
    here: on a 24 GiB card with 64 GiB of host RAM its transformer must load as nf4); a model's
    weights are not among what that fetch reads."""
    import shutil

    import torch

    from fleetgen.offload import DeviceSpec, Workload
    from fleetgen.offload.architectures import resolve
    from fleetgen.offload.weight_formats import CHOOSABLE, parse_quantize
    from fleetgen.workers.pipeline.plans import at_load_formats, model_configs
    from fleetgen.workers.spec import Source

    server, root = hub
    flux2 = server.repos["org/flux2-configs"] = Repo()
    commit = flux2.push(Path(shutil.copytree(resolve("flux.2-dev"), root / "flux2")))
    configs = model_configs(Source("org/flux2-configs", revision=commit))
    assert (Path(configs) / "transformer" / "config.json").exists()
    tight = DeviceSpec(budget=24 << 30, host_budget=64 << 30, formats=CHOOSABLE)
    work = Workload(
        width=1024, height=1024, steps=28, cfg=False, max_batch=1, quantize=parse_quantize("auto"), loaded=True
    )
    assert at_load_formats(configs, torch.bfloat16, tight, work, False) == {"transformer": "nf4"}

    _repo(hub, root, "org/tiny-weights")
    assert (Path(model_configs(Source("org/tiny-weights"))) / "unet" / "config.json").exists()
    fetched = {path for (name, _, path), _ in server.downloads.items() if name == "org/tiny-weights"}
    assert "unet/config.json" in fetched and all(p.endswith(".json") for p in fetched), fetched
    assert model_configs(Source("org/no-such-model")) is None  # the full download says what is wrong


def test_fleetgen_score_pins_a_hub_scorer_and_a_rerun_keeps_its_commit(
    hub, tiny_model, tiny_clip, tmp_path, capsys, monkeypatch
):
    """`fleetgen score OUT --score clip=ORG/NAME`: the model pinned to main's commit in the scores' claim;
    after the repo moves on, a rescored shard uses the claimed commit; another commit, or a revision
    the repo lacks, is one line and exit 2."""
    from fleetgen.cli import main
    from fleetgen.workers.tiny.scorers import write_tiny_scorer
    from tests.workers.pipeline.test_scoring import run

    clip = _clip_repo(hub, "org/tiny-score-clip")  # the weights of `tiny_clip` (seed 0)
    first = clip.refs["main"]
    manifest, out, _ = run(tiny_model, tmp_path, f"clip={tiny_clip}")
    args = ["score", str(out), "--score", "clip=org/tiny-score-clip", "--device", "cpu"]
    assert main(args) == 0
    said = capsys.readouterr()
    assert f"org/tiny-score-clip pinned to commit {first}" in said.out + said.err
    claim = json.loads((out / "scores" / "clip" / "_scorer.json").read_text())
    assert claim["model"] == f"org/tiny-score-clip@{first}"
    table = out / "scores" / "clip" / "shard-00000.parquet"
    scored = {r["id"]: r["score_clip"] for r in pq.read_table(table).to_pylist()}
    assert scored == pytest.approx({i: r["score_clip"] for i, r in manifest.items()}, abs=1e-5)  # same weights

    second = clip.push(write_tiny_scorer(hub[1] / "tiny-score-clip-v2", "clip", seed=7))
    table.unlink()
    assert main(args) == 0
    said = capsys.readouterr()
    assert f"org/tiny-score-clip: using commit {first}, pinned by the first run" in said.out + said.err
    assert {r["id"]: r["score_clip"] for r in pq.read_table(table).to_pylist()} == scored

    # HF_HUB_OFFLINE: the claimed commit resolved from this machine's hub cache, not the hub; a repo the
    # cache has never held is one line
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    table.unlink()
    assert main(args) == 0
    assert {r["id"]: r["score_clip"] for r in pq.read_table(table).to_pylist()} == scored
    capsys.readouterr()
    assert main(["score", str(out), "--score", "clip=org/never-cached", "--device", "cpu"]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "HF_HUB_OFFLINE is set and the hub cache" in error and "holds no `main` of `org/never-cached`" in error
    monkeypatch.undo()
    for model, said in [
        (f"org/tiny-score-clip@{second}", f"holds clip scores by org/tiny-score-clip@{first}"),
        ("org/tiny-score-clip@v9", "the revision `v9` does not exist in `org/tiny-score-clip`"),
        ("org/no-such-clip", "`--score clip` model `org/no-such-clip` was not found on the hub"),
    ]:
        assert main(["score", str(out), "--score", f"clip={model}", "--device", "cpu"]) == 2
        error = capsys.readouterr().err.strip().splitlines()[-1]  # after the pin's note, one line
        assert error.startswith("fleetgen: error:") and said in error, error

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


def test_the_pinned_commit_holds_across_a_resume_after_the_repo_moves_on(hub, ray_cluster, tmp_path):
    server, root = hub
    repo = _repo(hub, root, "org/tiny-pin")
    first = repo.refs["main"]
    prompts = write_prompts(tmp_path / "p.parquet", [f"pinned {i}" for i in range(4)], id=[f"r{i}" for i in range(4)])
    out = tmp_path / "out"
    log = io.StringIO()
    assert run_job(_job(prompts, "org/tiny-pin", out, workers=1), progress_stream=log).complete
    assert f"org/tiny-pin pinned to commit {first}" in log.getvalue()
    job = json.loads((out / "job.json").read_text())
    assert job["config"]["revision"] == first and job["fingerprint"]["model"] == f"org/tiny-pin@{first}"
    before = _shas(out)

    # The repo moves on (other weights on main); a shard of the job is lost and the job rerun as it was.
    second = repo.push(write_tiny_model(root / "tiny-pin-v2", seed=7))
    assert second != first and repo.refs["main"] == second
    (out / "shards" / "shard-00001.parquet").unlink()
    (out / "_SUCCESS").unlink()
    log = io.StringIO()
    again = run_job(_job(prompts, "org/tiny-pin", out, workers=1), progress_stream=log)
    assert again.complete and again.shards_skipped == 1
    assert f"using commit {first}, pinned in job.json" in log.getvalue()
    assert _shas(out) == before  # the redone shard was made with the first commit's weights

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

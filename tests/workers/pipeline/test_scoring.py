"""Scores in the generating pass (workers/pipeline/scoring.py), with tiny random-weight scorers of
the real classes (a CLIP model, LAION's aesthetic MLP over it, a ViT classifier with an `nsfw` label):
each image scored right after decoding, its scores in the manifest and in the stored records of every
output format (read back by `datasets` and `webdataset`); `--keep` stores exactly what its rule
passes; a scorer's failure on one image is that image's error field, never a lost image."""

from __future__ import annotations

import dataclasses
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from fleetgen.jobs.sharding import plan_shards, read_footer, resolve_columns
from fleetgen.scores import parse_keep, parse_scores
from fleetgen.workers.pipeline.scoring import Scoring
from fleetgen.workers.rows.shard import Columns
from fleetgen.workers.spec import GenerationSettings, WorkerSpec
from fleetgen.workers.tiny.scorers import write_tiny_scorer
from fleetgen.workers.worker import Worker

ROWS = {"id": [f"r{i}" for i in range(6)], "prompt": [f"a red fox, number {i}" for i in range(6)]}
SCORED = ("score_clip", "score_aesthetic", "score_nsfw")


@pytest.fixture(scope="module")
def scorers(tmp_path_factory) -> str:
    """`--score` for the three tiny scorers."""
    root = tmp_path_factory.mktemp("scorers")
    dirs = {k: write_tiny_scorer(root / k, k) for k in ("clip", "aesthetic", "nsfw")}
    return ",".join(f"{k}={d}" for k, d in dirs.items())


def run(
    model,
    tmp_path,
    score: str,
    keep: str | None = None,
    name="out",
    worker_hook=None,
    retry=False,
    rows=100,
    **settings,
):
    """One shard of ROWS through a worker (no Ray); returns (manifest rows by id, output dir, worker info).
    `retry`: the shard is committed already, its error rows made again (`--retry-errors`)."""
    path = tmp_path / "prompts.parquet"
    pq.write_table(pa.table(ROWS), path)
    files = [read_footer(str(path))]
    spec = parse_scores(score)
    base = {"steps": 2, "guidance": 5.0, "width": 64, "height": 64, "output_format": "files"}
    s = GenerationSettings(
        task="text-to-image", family="sd", score=spec, keep=parse_keep(keep, spec), **{**base, **settings}
    )
    out = tmp_path / name
    worker = Worker(
        WorkerSpec.of("w0", str(model), str(out), s, resolve_columns(files, Columns()), device="cpu", threads=1)
    )
    if worker_hook is not None:
        worker_hook(worker)
    try:
        for shard in plan_shards(files, rows):  # `rows` per shard
            worker.run_shard(dataclasses.replace(shard, retry_errors=True) if retry else shard)
        info = worker.describe()
    finally:
        worker.close()
    manifest = pq.read_table(out / "shards").to_pylist()
    # `fleetgen verify` reads the job record for the output format (the driver writes it in a job)
    (out / "job.json").write_text(json.dumps({"fingerprint": {"generation": {"output_format": s.output_format}}}))
    return {r["id"]: r for r in manifest}, out, info


@pytest.mark.parametrize(
    "output_format", ["parquet", *(pytest.param(f, marks=pytest.mark.slow) for f in ("files", "webdataset"))]
)
def test_every_image_is_scored_and_its_scores_are_in_every_output(output_format, tiny_model, scorers, tmp_path):
    import datasets

    manifest, out, info = run(tiny_model, tmp_path, scorers, output_format=output_format)
    assert all(r["status"] == "ok" and r["score_error"] is None for r in manifest.values())
    for column in SCORED:
        values = [r[column] for r in manifest.values()]
        assert all(isinstance(v, float) for v in values) and len(set(values)) > 1, column  # one per image
    assert all(0 <= r["score_nsfw"] <= 1 and -1 <= r["score_clip"] <= 1 for r in manifest.values())
    assert manifest["r0"]["score_pickscore"] is None  # not asked: null
    assert info["scoring"]["images"] == 6 and set(info["scoring"]["scorers"]) == {"clip", "aesthetic", "nsfw"}
    stored: dict[str, dict] = {}
    if output_format == "parquet":
        ds = datasets.load_dataset("parquet", data_files=str(out / "data" / "*.parquet"), split="train")
        stored = {r["id"]: r for r in ds}
    elif output_format == "webdataset":
        import webdataset as wds

        tars = str(out / "data" / "shard-00000.tar")
        stored = {s["__key__"]: json.loads(s["json"]) for s in wds.WebDataset(tars, shardshuffle=False)}
    if stored:
        assert stored.keys() == manifest.keys()
        for i, r in stored.items():
            assert {c: r[c] for c in SCORED} == pytest.approx({c: manifest[i][c] for c in SCORED})


@pytest.mark.slow
def test_scores_are_the_scorers_own_on_the_stored_pixels(tiny_model, scorers, tmp_path):
    """What the pass recorded is what the scorer says of the stored PNG (lossless: the same pixels)."""
    manifest, out, _ = run(tiny_model, tmp_path, scorers)
    scoring = Scoring(parse_scores(scorers), torch.device("cpu"), torch.float32)
    for i in ("r0", "r3"):
        picture = Image.open(out / manifest[i]["image"])
        ((again, error),) = scoring.score([picture], [manifest[i]["prompt"]])
        assert error is None
        assert again == pytest.approx({c.removeprefix("score_"): manifest[i][c] for c in SCORED}, abs=1e-5)


@pytest.mark.slow
def test_a_keep_rule_stores_exactly_what_it_passes(tiny_model, scorers, tmp_path):
    everything, _, _ = run(tiny_model, tmp_path, scorers, name="all")
    clips = sorted(r["score_clip"] for r in everything.values())
    bound = (clips[2] + clips[3]) / 2  # half of the images pass
    rule = f"clip >= {bound!r} and nsfw < 0.99"
    manifest, out, _ = run(tiny_model, tmp_path, scorers, keep=rule, name="kept")
    passing = {i for i, r in everything.items() if r["score_clip"] >= bound and r["score_nsfw"] < 0.99}
    assert len(passing) == 3
    assert {i for i, r in manifest.items() if r["status"] == "ok"} == passing
    for i, r in manifest.items():
        assert r["score_clip"] == pytest.approx(everything[i]["score_clip"])  # scores recorded either way
        if i in passing:
            assert (out / r["image"]).exists()
        else:
            assert r["status"] == "filtered" and r["image"] is None and f"--keep '{rule}'" in r["error"]
            assert "not stored" in r["error"] and r["nsfw"] is None  # not the safety checker's verdict
    stored = {p.stem for p in (out / "images").rglob("*.png")}
    assert stored == passing


def test_a_scorer_that_fails_on_one_image_records_its_error_and_stores_the_image(tiny_model, scorers, tmp_path):
    """A scorer raising on one picture (injected: a picture the tiny CLIP cannot read) costs that
    picture its score, not its place: stored, `score_error` said, the other scores kept."""

    def break_clip_on_r2(worker):
        real = worker.scoring.runs["clip"]
        r2 = []

        def run_clip(pictures, prompts):
            if any(p.endswith("number 2") for p in prompts):
                r2.append(1)
                raise ValueError("this picture cannot be read")
            return real(pictures, prompts)

        worker.scoring.runs["clip"] = run_clip

    manifest, out, _ = run(tiny_model, tmp_path, scorers, keep="clip > -2", worker_hook=break_clip_on_r2)
    bad = manifest["r2"]
    assert bad["status"] == "ok" and (out / bad["image"]).exists()
    assert bad["score_clip"] is None and bad["score_error"] == "clip: ValueError: this picture cannot be read"
    assert bad["score_aesthetic"] is not None and bad["score_nsfw"] is not None
    assert all(r["score_clip"] is not None and r["score_error"] is None for i, r in manifest.items() if i != "r2")


@pytest.mark.slow
@pytest.mark.parametrize("rank_by", ["clip", "-nsfw"])
def test_best_of_n_stores_the_best_candidate_and_records_every_one(rank_by, tiny_model, scorers, tmp_path):
    """3 candidates per image, each its own seed: the best by the score (highest; `-nsfw`: lowest) is the
    image, stored under its id; the others are filtered rows with their scores; verify --deep is clean."""
    from fleetgen.jobs.verify import verify

    manifest, out, _ = run(tiny_model, tmp_path, scorers, best_of=3, rank_by=rank_by, output_format="webdataset")
    name, sign = rank_by.removeprefix("-"), -1 if rank_by.startswith("-") else 1
    assert len(manifest) == 18 and len({r["seed"] for r in manifest.values()}) == 18
    for i in ROWS["id"]:
        candidates = [r for r in manifest.values() if r["row_id"] == i]
        assert sorted(r["candidate"] for r in candidates) == [0, 1, 2]
        (best,) = [r for r in candidates if r["status"] == "ok"]
        assert best["id"] == i and best["image"] is not None  # stored under the image's id
        assert sign * best[f"score_{name}"] == max(sign * r[f"score_{name}"] for r in candidates)
        for r in candidates:
            if r is not best:
                assert r["status"] == "filtered" and r["id"] == f"{i}~{r['candidate']}" and r["image"] is None
                assert f"not the best of 3 by {rank_by}" in r["error"]
    import webdataset as wds

    samples = {
        s["__key__"]: json.loads(s["json"])
        for s in wds.WebDataset(str(out / "data" / "shard-00000.tar"), shardshuffle=False)
    }
    assert sorted(samples) == sorted(ROWS["id"])  # one sample per image, its best candidate
    assert all(
        samples[i]["id"] == i and samples[i][f"score_{name}"] == pytest.approx(manifest[i][f"score_{name}"])
        for i in samples
    )
    assert verify(str(out), deep=True).clean


def test_retry_errors_with_best_of_remakes_only_the_images_without_a_stored_best(tiny_model, scorers, tmp_path):
    """Every candidate of r1 fails, and one of r2's (r2 still has its best): `--retry-errors` makes r1's
    three candidates again and stores its best; r2 and every other image keep their rows and bytes."""
    from fleetgen.jobs.verify import verify

    doomed = {"r1~0", "r1~1", "r1~2", "r2~1"}

    def fail(worker):
        real = worker.fitted.generate

        def generate(batch, inputs):
            made, failed = real(batch, inputs)
            for m in [m for m in made if m.id in doomed]:
                made.remove(m)
                failed[m.id] = "RuntimeError: injected"
            return made, failed

        worker.fitted.generate = generate

    common = {"best_of": 3, "rank_by": "clip"}
    first, out, _ = run(tiny_model, tmp_path, scorers, worker_hook=fail, **common)
    assert {i for i, r in first.items() if r["status"] == "error"} == doomed and "r1" not in first

    def images():
        return {str(p.relative_to(out)): p.read_bytes() for p in (out / "images").rglob("*.png")}

    stored = images()
    again, _, _ = run(tiny_model, tmp_path, scorers, retry=True, **common)
    r1 = [r for r in again.values() if r["row_id"] == "r1"]
    (best,) = [r for r in r1 if r["status"] == "ok"]
    assert best["id"] == "r1" and sorted(r["candidate"] for r in r1) == [0, 1, 2]
    assert best["score_clip"] == max(r["score_clip"] for r in r1)
    assert all(r["status"] == "filtered" for r in r1 if r is not best)
    for i, r in first.items():  # every other row as committed, r2's failed candidate too
        if r["row_id"] != "r1":
            assert again[i] == r, i
    after = images()
    assert len(after) == len(stored) + 1 and all(after[k] == data for k, data in stored.items())  # and r1's best
    assert verify(str(out), deep=True).clean


@pytest.mark.slow
def test_best_of_chooses_among_what_keep_keeps(tiny_model, scorers, tmp_path):
    everything, _, _ = run(tiny_model, tmp_path, scorers, best_of=3, rank_by="clip", name="all")
    nsfw = sorted(r["score_nsfw"] for r in everything.values())
    bound = (nsfw[8] + nsfw[9]) / 2
    manifest, _, _ = run(
        tiny_model, tmp_path, scorers, keep=f"nsfw < {bound!r}", best_of=3, rank_by="clip", name="kept"
    )
    for i in ROWS["id"]:
        candidates = {r["candidate"]: r for r in manifest.values() if r["row_id"] == i}
        passing = [r for r in candidates.values() if r["score_nsfw"] < bound]
        stored = [r for r in candidates.values() if r["status"] == "ok"]
        if not passing:
            assert not stored and all("kept out by --keep" in r["error"] for r in candidates.values())
        else:
            (best,) = stored
            assert best["score_clip"] == max(r["score_clip"] for r in passing) and best["id"] == i


@pytest.mark.gpu
def test_scorers_on_cuda_score_as_on_the_cpu(tmp_path):
    """The CUDA path (`make gpu-check`): the tiny scorers at bfloat16 on the device, the same pictures and
    prompts as float32 on the CPU, within bfloat16's rounding."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    spec = parse_scores(",".join(f"{k}={write_tiny_scorer(tmp_path / k, k)}" for k in ("clip", "aesthetic", "nsfw")))
    pictures = [Image.new("RGB", (64, 64), c) for c in ("red", "blue", "green")]
    prompts = ["a red square", "a blue square", "a green square"]
    cpu = Scoring(spec, torch.device("cpu"), torch.float32).score(pictures, prompts)
    before = torch.cuda.memory_allocated()
    scoring = Scoring(spec, torch.device("cuda"), torch.bfloat16)
    assert torch.cuda.memory_allocated() == before  # loaded into host memory
    cuda = scoring.score(pictures, prompts)
    weights = sum(p.numel() * p.element_size() for m in scoring.modules for p in m.parameters())
    assert torch.cuda.memory_allocated() - before >= weights  # on the device for their first score
    scoring.release()  # a phased plan's decode phase over: off it again
    assert torch.cuda.memory_allocated() - before < weights and scoring.snapshot()["moved_on"] == 1
    for (a, a_error), (b, b_error) in zip(cpu, cuda, strict=True):
        assert a_error is None and b_error is None and a.keys() == b.keys() == {"clip", "aesthetic", "nsfw"}
        assert all(abs(a[n] - b[n]) < 0.05 for n in a), (a, b)


def test_a_local_scorers_size_is_counted_from_its_weights(scorers):
    """The planner's figure for a local scorer (`ScoreSpec.params`, from its files' headers) is the
    parameters the worker loads; a hub model's is the registry's."""
    spec = parse_scores(scorers)
    scoring = Scoring(spec, torch.device("cpu"), torch.float32)
    loaded = sum(p.numel() for m in scoring.modules for p in m.parameters())
    assert sum(spec.params(n) for n in spec.names) == loaded > 0
    assert spec.reserved_bytes(4) == int(loaded * 4 * 1.25)
    assert parse_scores("clip").params("clip") == 428_000_000


@pytest.mark.slow
def test_hpsv2_loads_open_clips_vit_h_14_from_a_checkpoint_as_hps_ships_it(tmp_path):
    """`hpsv2` against the real open_clip ViT-H-14 (random weights, saved as HPS v2.1's checkpoint is: a dict
    with `state_dict`): each picture scored, a batch as each alone. Needs open_clip_torch and torchvision,
    which do not install beside CI's CPU torch: run by hand in a venv with torch 2.14.1 + torchvision 0.29.1
    (`PYTHONPATH=. pytest -m slow -k hpsv2`; 2026-12-03: open_clip 3.3.0, 54 s, 8 GiB)."""
    open_clip = pytest.importorskip("open_clip")
    model, _, _ = open_clip.create_model_and_transforms("ViT-H-14", pretrained=None)
    torch.save({"state_dict": model.state_dict()}, tmp_path / "HPS_v2.1_compressed.pt")
    del model
    scoring = Scoring(parse_scores(f"hpsv2={tmp_path / 'HPS_v2.1_compressed.pt'}"), torch.device("cpu"), torch.float32)
    pictures = [Image.new("RGB", (64, 64), c) for c in ("red", "blue")]
    batch = scoring.score(pictures, ["a red square", "a blue square"])
    ((alone, _),) = scoring.score(pictures[:1], ["a red square"])
    assert all(error is None and -1 <= scores["hpsv2"] <= 1 for scores, error in batch)
    assert batch[0][0]["hpsv2"] == pytest.approx(alone["hpsv2"], abs=1e-4)

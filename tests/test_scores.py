"""`--score` and `--keep` as a user types them (fleetgen/scores.py): parsed once, with one message for
each mistake, before any worker starts (exit 2)."""

import importlib.util

import pytest

from fleetgen.errors import ConfigError
from fleetgen.scores import KeepRule, ScoreSpec, parse_keep, parse_scores

SCORES = ScoreSpec((("clip", "m/clip"), ("nsfw", "m/nsfw"), ("aesthetic", "/a.pth")))


def test_scorers_are_parsed_once_with_their_default_models(tmp_path, monkeypatch):
    spec = parse_scores("clip, nsfw=Org/classifier")
    assert spec.scorers == (("clip", "openai/clip-vit-large-patch14"), ("nsfw", "Org/classifier"))
    assert spec.label == "clip=openai/clip-vit-large-patch14,nsfw=Org/classifier"
    assert parse_scores(spec) is spec and not parse_scores("none") and not parse_scores(None)
    (tmp_path / "heads").mkdir()
    (tmp_path / "heads" / "head.pth").write_bytes(b"x")
    monkeypatch.chdir(tmp_path / "heads")
    # as typed, relative: one absolute spelling (workers start in other directories)
    for typed in ("./head.pth", "../heads/head.pth", "head.pth"):
        assert parse_scores(f"aesthetic={typed}").scorers == (("aesthetic", str(tmp_path / "heads" / "head.pth")),)
    # the hub models each scorer reads, which the driver pins: a head file reads CLIP L/14 from the hub;
    # PickScore's processor comes from CLIP-H's repository; a revision asked with @ is the hub id's
    head = parse_scores("aesthetic=head.pth,pickscore")
    assert head.hub_models("aesthetic") == ("openai/clip-vit-large-patch14",)
    assert head.hub_models("pickscore") == ("yuvalkirstain/PickScore_v1", "laion/CLIP-ViT-H-14-laion2B-s32B-b79K")
    at = parse_scores("clip=Org/clip@v2,aesthetic=../heads")
    assert at.scorers == (("clip", "Org/clip"), ("aesthetic", str(tmp_path / "heads")))
    assert at.revision("Org/clip") == "v2" and at.label == f"clip=Org/clip,aesthetic={tmp_path / 'heads'}"
    assert at.hub_models("aesthetic") == ()  # a directory holds its CLIP


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            "clipp",
            "`--score` takes NAME[=MODEL],... with NAME one of clip, pickscore, hpsv2, aesthetic, nsfw; got `clipp`",
        ),
        ("clip,clip", "`--score` names `clip` twice"),
        ("clip=", "`--score clip=` names no model"),
        ("aesthetic", "`--score aesthetic` needs its weights"),
        ("clip=Org/clip@", "`--score clip=Org/clip@`: write a hub model's revision as NAME=ORG/MODEL@REV"),
    ],
)
def test_a_bad_scorer_is_one_message(value, message):
    with pytest.raises(ConfigError, match="^" + message.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        parse_scores(value)


def test_keep_rules_read_scores_only_and_keep_exactly_what_they_say():
    rule = parse_keep("clip >= 0.26 and nsfw<0.5", SCORES)
    assert rule.text == "clip >= 0.26 and nsfw<0.5" and rule.names() == ("clip", "nsfw")
    assert rule.keeps({"clip": 0.3, "nsfw": 0.1}) is True
    assert rule.keeps({"clip": 0.26, "nsfw": 0.1}) is True  # >= includes the bound
    assert rule.keeps({"clip": 0.2, "nsfw": 0.1}) is False
    assert rule.keeps({"clip": 0.3, "nsfw": 0.5}) is False
    assert rule.keeps({"clip": None, "nsfw": 0.1}) is None  # a scorer failed: undecided, the image is stored
    chained = parse_keep("0.2 < clip <= 0.3 or not aesthetic > -1", SCORES)
    assert chained.keeps({"clip": 0.25, "aesthetic": 0}) and not chained.keeps({"clip": 0.35, "aesthetic": 0})
    assert chained.keeps({"clip": 0.35, "aesthetic": -2})
    assert "clip 0.2" in rule.why({"clip": 0.2, "nsfw": 0.1}) and not parse_keep("none", SCORES)
    assert parse_keep(KeepRule("clip>0"), SCORES).text == "clip>0"


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        ("clip >= ", "`--keep` is comparisons of scores"),
        ("clip == 0.3", "compare with <, <=, > or >="),
        ("__import__('os').system('true')", "is not a comparison"),
        ("clip > nsfw.real", "is neither a score nor a number"),
        ("1 < 2", "reads no score"),
        ("pickscore > 20", "`--keep` reads pickscore, which the job does not score; it scores: clip, nsfw, aesthetic"),
    ],
)
def test_a_bad_keep_rule_is_one_message(rule, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        parse_keep(rule, SCORES)
    assert "\n" not in str(err.value)


def test_keep_without_scores_and_a_missing_package_or_model_are_refused_before_any_worker(tmp_path, capsys):
    from fleetgen.cli import main

    base = ["run", "--input", str(tmp_path / "p.parquet"), "--output", str(tmp_path / "out"), "--model", "org/m"]
    assert main([*base, "--keep", "clip>0.2"]) == 2
    assert "`--keep` reads clip, which the job does not score; it scores: none (add --score)" in capsys.readouterr().err
    for bad, said in [
        (["--best-of", "3"], "`--best-of N` (N > 1) and `--rank-by NAME` go together"),
        (["--best-of", "3", "--rank-by", "clip"], "`--rank-by clip` names a score the job does not compute"),
        (["--best-of", "0"], "`--best-of` must be 1 to 64, got `0`"),
    ]:
        assert main([*base, *bad]) == 2
        assert said in capsys.readouterr().err
    assert main([*base, "--score", "clip=./no-such-dir"]) == 2
    assert "`--score clip=./no-such-dir`: no such file or directory" in capsys.readouterr().err
    if importlib.util.find_spec("open_clip") is not None:
        return  # the missing-package case needs an environment without it (the test environment has none)
    assert main([*base, "--score", "hpsv2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "`--score hpsv2` needs the open_clip_torch package: pip install open_clip_torch" in err and "\n" not in err


def test_a_scored_jobs_config_round_trips_through_its_record(tmp_path):
    """`JobConfig.to_dict()` (job.json's `config`, what `--retry-errors` rebuilds a job from) holds the
    scorers and the rule by their one spelling, and builds the same job again."""
    from fleetgen.jobs.config import JobConfig

    head = tmp_path / "head.pth"
    head.write_bytes(b"x")
    config = JobConfig.of(
        input="p", output="o", model="m/m", score=f"clip,aesthetic={head}", keep="clip > 0.2 and aesthetic >= 5"
    )
    record = config.to_dict()
    assert record["score"] == f"clip=openai/clip-vit-large-patch14,aesthetic={head}"
    assert record["keep"] == "clip > 0.2 and aesthetic >= 5"
    assert (
        JobConfig.of(**record) == config
        and JobConfig.of(**JobConfig.of(input="p", output="o", model="m/m").to_dict()).generation.keep == KeepRule()
    )

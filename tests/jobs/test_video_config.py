"""A video job decided on the driver: the Wan families told apart from their configs, the card's
defaults where the user gives none, the frame-count rule, frame settings refused where a job makes
images, and the encoder options checked before any worker starts."""

from __future__ import annotations

import pytest

from fleetgen.cli import main
from fleetgen.errors import ConfigError
from fleetgen.jobs.config import JobConfig, validate
from fleetgen.jobs.models import describe, resolve_defaults
from fleetgen.workers.families.detect import identify, identify_dir
from fleetgen.workers.rows.shard import Columns
from fleetgen.workers.tiny import write_tiny_model
from tests.conftest import write_prompts

NO_COLUMNS = Columns.of("prompt", None, None, None)


@pytest.fixture(scope="module")
def wan(tmp_path_factory) -> str:
    return str(write_tiny_model(tmp_path_factory.mktemp("wan") / "wan", family="wan"))


def resolve(model, tmp_path, columns: Columns = NO_COLUMNS, **options):
    prompts = write_prompts(tmp_path / "p.parquet", ["a red fox"])
    config = JobConfig.of(input=str(prompts), output=str(tmp_path / "o"), model=str(model), **options)
    return resolve_defaults(validate(config), columns)


def test_the_wan_checkpoints_are_told_apart_by_their_configs(wan, tmp_path):
    assert identify_dir(wan)[0].name == "wan"
    assert identify({"_class_name": "WanPipeline", "transformer_2": ["diffusers", "WanTransformer3DModel"]})[
        0
    ].name == ("wan2.2")
    assert identify({"_class_name": "WanPipeline", "transformer_2": [None, None]})[0].name == "wan"
    ti2v, why = identify({"_class_name": "WanPipeline"}, {"in_channels": 48})
    assert ti2v.name == "wan-ti2v" and "48 latent channels" in why
    assert identify({"_class_name": "WanImageToVideoPipeline"})[0].name == "wan-i2v"


def test_a_video_job_takes_the_cards_size_frames_and_rate(wan, tmp_path):
    config, family, sources = resolve(wan, tmp_path)
    assert (
        config.generation.task,
        config.generation.width,
        config.generation.height,
        config.generation.num_frames,
        config.generation.fps,
    ) == ("text-to-video", 832, 480, 81, 16.0)
    assert (config.generation.steps, config.generation.guidance) == (50, 5.0)
    assert {k: sources[k] for k in ("width", "num_frames", "fps")} == dict.fromkeys(
        ("width", "num_frames", "fps"), "family default"
    )
    assert "81 frames at 16 fps (family default)" in describe(config, family, sources)
    settings = config.generation
    assert settings.media_format() == "mp4" and settings.companions() == ("poster",)
    given, _, sources = resolve(wan, tmp_path, width=64, height=48, num_frames=9, fps=24)
    g = given.generation
    assert (g.width, g.height, g.num_frames, g.fps, sources["num_frames"]) == (64, 48, 9, 24, "given")


def test_frame_counts_wan_would_round_are_refused(wan, tmp_path):
    with pytest.raises(ConfigError, match=r"`--num-frames`: num_frames `80` is not 4k\+1, .* \(e.g. 77 or 81\)"):
        resolve(wan, tmp_path, num_frames=80)


def test_frame_settings_for_a_job_that_makes_images_are_refused(tiny_model, tmp_path):
    with pytest.raises(ConfigError, match="`--num-frames`: sd text-to-image makes images, not clips"):
        resolve(tiny_model, tmp_path, num_frames=9)
    columns = Columns.of("prompt", None, None, None, fps="fps")
    with pytest.raises(ConfigError, match="the `fps` column: sd text-to-image makes images"):
        resolve(tiny_model, tmp_path, columns)
    with pytest.raises(ConfigError, match="`--store-frames`: sd text-to-image makes images, not clips"):
        resolve(tiny_model, tmp_path, store_frames=True)
    config, _, _ = resolve(tiny_model, tmp_path)
    assert (config.generation.width, config.generation.height, config.generation.num_frames) == (
        512,
        512,
        None,
    )  # images: as before


@pytest.mark.parametrize(
    "options, message",
    [
        ({"crf": 60}, "`--crf` must be 0 to 51 for mp4"),
        ({"crf": 60, "video_format": "webm"}, None),
        ({"num_frames": 0}, "`--num-frames` must be 1 to 2049"),
        ({"fps": 0}, "`--fps` must be more than 0"),
        ({"video_format": "gif"}, "`--video-format` must be one of mp4, webm"),
    ],
)
def test_bad_video_options_are_refused(options, message, wan, tmp_path):
    """A value its setting does not declare is refused as the record is built; a rule across settings
    (`--crf` by `--video-format`) by `validate`."""
    if message is None:
        validate(JobConfig.of(input="x", output=str(tmp_path), model=wan, **options))
        return
    with pytest.raises(ConfigError, match=message):
        validate(JobConfig.of(input="x", output=str(tmp_path), model=wan, **options))


def test_the_cli_refuses_before_starting_anything(wan, tmp_path, capsys):
    prompts = write_prompts(tmp_path / "p.parquet", ["a red fox"])
    args = ["run", "--input", str(prompts), "--output", str(tmp_path / "o"), "--model", wan, "--num-frames", "10"]
    assert main(args) == 2
    assert "num_frames `10` is not 4k+1" in capsys.readouterr().err
    assert not (tmp_path / "o" / "job.json").exists()


def test_frames_rate_and_encoding_are_in_the_fingerprint(wan, tmp_path):
    from fleetgen.jobs.sharding import read_footer
    from fleetgen.jobs.state import _differences, fingerprint

    prompts = write_prompts(tmp_path / "p.parquet", ["a red fox"])
    files = [read_footer(str(prompts))]
    prints = {
        k: fingerprint(resolve(wan, tmp_path, **o)[0], files, NO_COLUMNS)
        for k, o in {
            "a": {"num_frames": 9},
            "b": {"num_frames": 13},
            "c": {"num_frames": 9, "crf": 23},
            "d": {"num_frames": 9, "store_frames": True},
        }.items()
    }
    assert _differences(prints["a"], prints["b"]) == ["generation.num_frames differs: 9 vs 13"]
    assert _differences(prints["a"], prints["c"]) == ["generation.crf differs: 18 vs 23"]
    assert _differences(prints["a"], prints["d"]) == ["generation.store_frames differs: False vs True"]

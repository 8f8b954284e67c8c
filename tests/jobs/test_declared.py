"""A setting's declared choices and bounds (fleetgen/settings.py `check_value`) hold wherever a value enters:
the command line, a TOML file, `fleetgen.run`, `fleetgen.plan` and the Ray Data stage's resolution refuse a
value the declaration does not allow, with one message made from the declaration."""

import pytest

import fleetgen
from fleetgen.errors import ConfigError
from fleetgen.jobs.config import job_settings, make_config
from fleetgen.settings import bounds_text


def _bad(row):
    """A value the row's declaration refuses (None where it declares nothing)."""
    if row.choice_list is not None:
        return "not-a-choice"
    if row.at_least is not None:
        return row.at_least - 1
    if row.more_than is not None:
        return row.more_than
    if row.at_most is not None:
        return row.at_most + 1
    return None


DECLARED = [r for r in job_settings() if _bad(r) is not None]


def test_the_declared_settings_are_the_ones_validate_used_to_check_by_hand():
    names = {r.name for r in DECLARED}
    assert {"host_copy", "plan_trials", "offload", "phases", "dtype", "task", "resize", "output_format"} <= names
    assert {"steps", "seed", "strength", "images_per_prompt", "best_of", "num_frames", "fps", "max_workers"} <= names


@pytest.mark.parametrize("row", DECLARED, ids=lambda r: r.name)
def test_every_declared_setting_refuses_what_it_does_not_declare(row, tmp_path):
    """Each such setting, as a keyword of the API and as a TOML key: refused naming its option and what it takes."""
    bad = _bad(row)
    value = (bad,) if row.typed == "tuple" else bad
    said = (
        f"must be one of {', '.join(map(str, row.choice_list))}; got `{bad}`."
        if row.choice_list is not None
        else f"must be {bounds_text(row)}, got `{bad}`."
    )
    with pytest.raises(ConfigError) as err:
        make_config({"input": "in.parquet", "output": "out", "model": "org/model", row.name: value})
    assert str(err.value) == f"`{row.option}` {said}"
    toml = tmp_path / "job.toml"
    shown = f'"{bad}"' if isinstance(bad, str) else bad
    toml.write_text(f"{row.name} = {[shown] if row.typed == 'tuple' else shown}\n".replace("'", ""))
    with pytest.raises(ConfigError) as err:
        make_config({"input": "in.parquet", "output": "out", "model": "org/model"}, str(toml))
    assert str(err.value).startswith(f"`{row.option}` {said.split('got')[0]}")  # a float's value as TOML types it


def test_a_misspelt_choice_is_refused_everywhere_and_the_closest_named(tiny_model, tmp_path, capsys):
    """`host_copy="nod"` used to run with a copy per worker, and `plan_trials="sometimes"` as `on`: now
    refused by `fleetgen.run`, a TOML file, `fleetgen.plan` and the command line, naming the closest."""
    from fleetgen.cli import main

    with pytest.raises(
        ConfigError, match=r"`--host-copy` must be one of node, worker; got `nod`\. Did you mean `node`\?"
    ):
        fleetgen.run(str(tmp_path / "p.parquet"), str(tmp_path / "out"), tiny_model, host_copy="nod")
    with pytest.raises(ConfigError, match=r"`--plan-trials` must be one of auto, on, off; got `sometimes`"):
        fleetgen.run(str(tmp_path / "p.parquet"), str(tmp_path / "out"), tiny_model, plan_trials="sometimes")
    toml = tmp_path / "job.toml"
    toml.write_text('host_copy = "nod"\n')
    with pytest.raises(ConfigError, match="`--host-copy` must be one of node, worker; got `nod`"):
        fleetgen.run(str(tmp_path / "p.parquet"), str(tmp_path / "out"), tiny_model, config=str(toml))
    with pytest.raises(ConfigError, match="`--host-copy` must be one of node, worker; got `nod`"):
        fleetgen.plan(tiny_model, "8GiB", host_copy="nod")
    with pytest.raises(SystemExit) as exit_:  # argparse's own refusal, from the same declared choices
        main(["plan", tiny_model, "--gpu-memory", "8GiB", "--host-copy", "nod"])
    assert exit_.value.code == 2 and "argument --host-copy: invalid choice: 'nod'" in capsys.readouterr().err


def test_the_stage_refuses_a_bad_choice_before_anything_runs(tiny_model):
    """The stage's resolution (jobs/stage.py) refuses it too, with no Ray at all."""
    import pyarrow as pa

    from fleetgen.jobs.stage import DatasetFacts, resolve_stage

    facts = DatasetFacts(unique=lambda c: [], largest=lambda c: None)
    schema = pa.schema([("id", pa.string()), ("prompt", pa.string())])
    with pytest.raises(ConfigError, match="`--host-copy` must be one of node, worker; got `nod`"):
        resolve_stage(schema, tiny_model, {"host_copy": "nod"}, facts)
    with pytest.raises(ConfigError, match=r"`--fps` must be more than 0 and at most \d+, got `0`"):
        resolve_stage(schema, tiny_model, {"fps": 0}, facts)


@pytest.mark.parametrize(
    "name, value, said",
    [
        ("max_batch", 2.5, "`--max-batch` must be a whole number, got `2.5`."),
        ("steps", "4", "`--steps` must be a number, got `'4'`."),
        ("cpu_threads", True, "`--cpu-threads` must be a number, got `True`."),
        ("commit_interval", float("nan"), "`--commit-interval` must be a number, got `nan`."),  # passed every bound
        ("guidance", float("nan"), "`--guidance` must be a number, got `nan`."),
    ],
)
def test_a_number_setting_refuses_what_the_command_line_would(name, value, said):
    """What argparse's `type=int` refuses on the command line is refused through the API too; NaN
    (which `float("nan")` and the command line's `nan` give) by every number setting."""
    with pytest.raises(ConfigError) as err:
        make_config({"input": "in.parquet", "output": "out", "model": "org/model", name: value})
    assert str(err.value) == said

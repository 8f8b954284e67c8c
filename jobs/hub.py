"""Hub models pinned to a commit: the pipeline's (`--model ORG/NAME`, `--revision`) and the scorers'
(`--score NAME=ORG/NAME[@REV]`), each resolved once, on the driver (and by `fleetgen score`), to the
commit every worker then loads and every rerun keeps (`job.json`, a score table's claim). Offline
(`HF_HUB_OFFLINE=1`) the hub cache answers instead of the hub.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from fleetgen.errors import ConfigError, one_line
from fleetgen.jobs.config import JobConfig
from fleetgen.scores import ScoreSpec
from fleetgen.workers.families.model_dir import is_hub_id

# Hub settings that travel from the driver to every worker (as their runtime env), so a worker on
# any node reaches the same hub, with the user's token for gated models.
HUB_ENV = ("HF_ENDPOINT", "HF_TOKEN", "HF_HUB_OFFLINE")


def pin_revision(config: JobConfig, pinned: str | None) -> tuple[JobConfig, str | None]:
    """A hub model's `--revision` (default: the commit this output's job pinned, else main)
    resolved once, here, to a commit; every worker and every resume then loads that commit.
    Returns the config and a note for the log. Errors name the model and what to do."""
    if not is_hub_id(config.source.model):
        return config, None
    m = config.source.model
    sha = hub_commit(m, config.source.revision or pinned or "main", f"`--model` `{m}`", "`--revision`")
    note = f"{m} pinned to commit {sha}"
    if pinned and not config.source.revision:
        note = f"{m}: using commit {sha}, pinned in job.json by the first run of this job"
    return config.with_options(revision=sha), note


def pin_scorers(spec: ScoreSpec, pinned: dict[str, str]) -> tuple[ScoreSpec, list[str]]:
    """Each hub model the scorers read pinned to a commit as the pipeline's is: the revision asked
    (`--score clip=ORG/NAME@REV`), else the commit `pinned` holds for it (this output's job, or its
    scores' claim), else main. Returns the spec with `revisions` all commits, and notes for the log."""
    revisions, notes = {}, []
    for name, _ in spec.scorers:
        for m in spec.hub_models(name):
            if m in revisions:
                continue
            asked = spec.revision(m)
            revisions[m] = hub_commit(
                m, asked or pinned.get(m) or "main", f"`--score {name}` model `{m}`", "the revision"
            )
            kept = not asked and m in pinned
            notes.append(
                f"{m}: using commit {revisions[m]}, pinned by the first run"
                if kept
                else f"{m} pinned to commit {revisions[m]}"
            )
    return replace(spec, revisions=tuple(revisions.items())), notes


def hub_commit(model: str, wanted: str, what: str, flag: str) -> str:
    """The commit `wanted` (a branch, tag or commit) names in hub repository `model`; a `ConfigError`
    naming `what` (the option that asked for it) and what to do where the hub says no."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    if constants.is_offline_mode():  # HF_HUB_OFFLINE=1: what this machine's hub cache names
        return cached_commit(model, wanted, what)
    try:
        return HfApi().model_info(model, revision=wanted).sha
    except GatedRepoError as err:
        raise ConfigError(
            f"{what} is gated on the hub and this token cannot read it: accept its terms on "
            "its page, then set HF_TOKEN (a read token) where you run fleetgen; workers get it from "
            "the driver."
        ) from err
    except RepositoryNotFoundError as err:
        raise ConfigError(
            f"{what} was not found on the hub ({constants.ENDPOINT}). Check the id; a private repo needs HF_TOKEN."
        ) from err
    except RevisionNotFoundError as err:
        raise ConfigError(f"{flag} `{wanted}` does not exist in `{model}`.") from err
    except Exception as err:  # noqa: BLE001 - no network, a proxy, a timeout: one clear message
        raise ConfigError(
            f"Could not reach the hub ({constants.ENDPOINT}) to resolve {what}: {one_line(err)}. Check the "
            "network, or pass a local directory."
        ) from err


def cached_commit(model: str, wanted: str, what: str) -> str:
    """Offline, the commit the hub cache (HF_HUB_CACHE) holds for `wanted` (a branch or tag it has seen,
    or a commit it has a snapshot of); a `ConfigError` saying what to do where it holds none."""
    from huggingface_hub import constants

    repo = Path(constants.HF_HUB_CACHE) / f"models--{model.replace('/', '--')}"
    ref = repo / "refs" / wanted
    sha = ref.read_text().strip() if ref.is_file() else wanted
    if (repo / "snapshots" / sha).is_dir():
        return sha
    raise ConfigError(
        f"{what}: HF_HUB_OFFLINE is set and the hub cache ({constants.HF_HUB_CACHE}) holds no `{wanted}` of "
        f"`{model}`. Download it once with the hub reachable, or pass a local directory."
    )

"""A resumed image-input job checks that the input images its committed shards were made from are
still the same bytes: a row's inputs are part of what its images are (their sha256 is in every
image's record), and a URL is not content. Each input's object is asked for its version (size and
ETag or mtime, one metadata request); only one whose version changed is read and hashed again, so a
`touch` is not a change and a replaced file is."""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor

from fleetgen.errors import ConfigError
from fleetgen.jobs.state import read_manifests
from fleetgen.workers.output.storage import Output, guarded, url_to_fs, version_of

THREADS = 32


def _current(source: str, version: str, sha256: str) -> tuple[str, str | None]:
    """(what became of the input, its new sha256): same, changed or missing."""
    fs, path = url_to_fs(source)
    try:
        info = guarded("check", source, lambda: fs.info(path))
        if version_of(info) == version and not version.endswith(":None"):  # a server with no ETag or mtime: hash
            return "same", None
        data = guarded("read", source, lambda: fs.cat_file(path))
    except FileNotFoundError:
        return "missing", None
    digest = hashlib.sha256(data).hexdigest()
    return ("same" if digest == sha256 else "changed"), digest


def recorded_inputs(output: Output, shards: list[str]) -> dict[str, tuple[str, str]]:
    """{source: (version, sha256)} of every input read from a path or URL by these committed shards."""

    found = {}
    for rows in read_manifests(output, shards, ["inputs"]).values():  # fetched together
        for x in (x for row in rows for x in row.get("inputs") or ()):
            if x.get("version"):  # bytes in the column: the input file's fingerprint covers them
                found[x["source"]] = (x["version"], x["sha256"])
    return found


def check_unchanged(output: Output, shards: list[str], say=print) -> int:
    """Refuse to resume when an input image of a committed shard changed; returns how many were checked."""
    recorded = recorded_inputs(output, shards)
    if not recorded:
        return 0
    with ThreadPoolExecutor(THREADS) as pool:
        results = dict(zip(recorded, pool.map(lambda s: _current(s, *recorded[s]), recorded), strict=True))
    changed = [s for s, (what, _) in results.items() if what == "changed"]
    missing = [s for s, (what, _) in results.items() if what == "missing"]
    if changed:
        first = changed[0]
        raise ConfigError(
            f"{len(changed)} input image(s) changed since this job made images from them (e.g. `{first}`: "
            f"sha256 {recorded[first][1][:12]}… then, {results[first][1][:12]}… now): the committed images no "
            "longer match their inputs. Pass `--overwrite` to start the job over, restore the inputs, or use a "
            "new `--output`."
        )
    if missing:
        say(f"{len(missing)} input image(s) of committed shards are gone (e.g. `{missing[0]}`); their images stay")
    return len(recorded)

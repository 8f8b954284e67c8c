"""`fleetgen verify OUT [--deep] [--fix]`: every stored byte against the manifests.

Shard by shard (memory bounded by one shard), it checks that each image a committed manifest names
is stored where the manifest says (a file, a webdataset tar member, a parquet row) with the size and
sha256 it records, and finds what no manifest names:

    missing    an image the manifest names is not stored
    mismatch   stored, but its size (always) or sha256 (--deep: every image; else a sample) differs
    orphan     an object no committed manifest names (an image file, a shard's data object)
    leftover   an attempt's staging (`_attempts/`) or a temporary file of a writer that died

A shard not yet committed whole may have parts (workers/output/parts.py): each part's images are
checked the same way where they wait, in the staging the part names.

`--fix` removes orphans and leftovers, and un-commits shards with missing or mismatched images (their
manifests and objects go, and `_SUCCESS`), and parts from the first damaged one on, so that rerunning
the job redoes exactly those rows.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from fleetgen.errors import ShardError, StorageError
from fleetgen.jobs.lock import live_lock
from fleetgen.jobs.state import committed_shards
from fleetgen.workers.output.commit import staging
from fleetgen.workers.output.formats import OutputFormat, Unreadable, get_format
from fleetgen.workers.output.layout import JOB, LOCK, PARTS, SHARDS, STAGING, SUCCESS, manifest_key, part_key
from fleetgen.workers.output.parts import finish_attempts, part_of, read_chain
from fleetgen.workers.output.storage import TMP_MARK, Output

KINDS = ("missing", "mismatch", "orphan", "leftover")
SAMPLE_EVERY = 16  # without --deep, every 16th image of a shard (and its first) is hashed
EXAMPLES = 5  # per kind, in the report


@dataclass
class VerifyReport:
    url: str
    deep: bool
    shards: int = 0  # committed shards checked
    images: int = 0  # images the manifests name
    hashed: int = 0  # images whose sha256 was computed
    bytes_read: int = 0
    seconds: float = 0.0
    counts: dict = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    examples: dict = field(default_factory=lambda: {k: [] for k in KINDS})
    uncommitted: list = field(default_factory=list)  # shards whose manifests --fix removed
    removed: int = 0  # objects --fix removed
    refused: str | None = None  # why --fix changed nothing

    @property
    def clean(self) -> bool:
        return not any(self.counts.values())

    def add(self, kind: str, where: str, detail: str = "") -> None:
        self.counts[kind] += 1
        if len(self.examples[kind]) < EXAMPLES:
            self.examples[kind].append(f"{where}{': ' + detail if detail else ''}")

    def text(self) -> str:
        rate = (
            f"{self.images / self.seconds:.0f} images/s, {self.bytes_read / self.seconds / 1e6:.1f} MB/s"
            if self.seconds
            else ""
        )
        lines = [
            f"verified {self.url}: {self.shards} committed shards, {self.images} images "
            f"({self.hashed} hashed{', every byte' if self.deep else ', a sample'}) in {self.seconds:.1f} s ({rate})"
        ]
        for kind in KINDS:
            if self.counts[kind]:
                lines.append(f"{self.counts[kind]} {kind}: " + "; ".join(self.examples[kind]))
        if self.uncommitted:
            lines.append(
                f"--fix: un-committed {len(self.uncommitted)} shard(s) ({', '.join(self.uncommitted[:5])}"
                f"{', ...' if len(self.uncommitted) > 5 else ''}); rerun the job to redo them"
            )
        if self.removed:
            lines.append(f"--fix: removed {self.removed} orphan, leftover or un-committed object(s) and prefix(es)")
        if self.refused:
            lines.append(f"--fix refused: {self.refused}")
        lines.append("clean" if self.clean else "PROBLEMS FOUND")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            k: getattr(self, k)
            for k in (
                "url",
                "deep",
                "shards",
                "images",
                "hashed",
                "bytes_read",
                "seconds",
                "counts",
                "examples",
                "uncommitted",
                "removed",
                "refused",
            )
        } | {"clean": self.clean}


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _clip_problem(data: bytes, row: dict) -> str | None:
    """Why a stored clip is not the one its manifest row describes (decoded frame by frame), or None."""
    from fleetgen.workers.output.video import read_clip

    try:
        clip = read_clip(data)
    except ValueError as err:
        return str(err)
    if clip.frames != row["num_frames"]:
        return f"{clip.frames} frames decode; the manifest says {row['num_frames']}"
    if clip.audio_codec != row.get("audio_codec"):  # a clip made with sound keeps it, and one without has none
        return f"its sound is {clip.audio_codec or 'absent'}; the manifest says {row.get('audio_codec') or 'none'}"
    if clip.audio_codec and not clip.audio_samples:
        return "its sound stream decodes to no samples"
    return None


class _Checker:
    def __init__(self, output: Output, report: VerifyReport, deep: bool, fmt: OutputFormat):
        self.output, self.report, self.deep, self.fmt = output, report, deep, fmt
        self.orphans: list[str] = []  # keys --fix removes

    def _compare(self, shard: str, row: dict, data: bytes | None, size: int | None, i: int, store: Output) -> bool:
        """One image: False when it is missing or differs (recorded)."""
        where = f"{shard}/{row['id']}"
        if size is None:
            self.report.add("missing", where, row["image"] + (f" [{row['member']}]" if row["member"] else ""))
            return False
        if row.get("size") is not None and size != row["size"]:
            self.report.add("mismatch", where, f"{size} bytes stored, {row['size']} in the manifest")
            return False
        if self.deep or i % SAMPLE_EVERY == 0:
            if data is None:
                data = store.get(row["image"])
            self.report.hashed += 1
            self.report.bytes_read += len(data)
            if _sha(data) != row["sha256"]:
                self.report.add("mismatch", where, "sha256 differs from the manifest")
                return False
            if self.deep and row.get("num_frames"):  # a clip: every frame decodes, as many as were made
                why = _clip_problem(data, row)
                if why:
                    self.report.add("mismatch", where, why)
                    return False
        return True

    def check(self, shard: str, rows: list[dict], where: Output | None = None) -> bool:
        """A committed shard's ok rows against what its output format finds stored; False when an
        image is missing or differs. Bytes are read for the first and every 16th image (all with
        --deep). `where`: a part's staging, read as the shard's location (what else it holds is not
        the part's: rows it did not commit)."""
        wanted = None if self.deep else {r["id"] for i, r in enumerate(rows) if i % SAMPLE_EVERY == 0}
        try:
            stored, extra = self.fmt.read_back(where or self.output, shard, rows, wanted)
        except Unreadable as err:
            self.report.add("mismatch", self.fmt.shard_objects(shard)[0], str(err))
            return False
        ok = True
        for i, row in enumerate(rows):
            size, data = stored[row["id"]]
            ok &= self._compare(shard, row, data, size, i, where or self.output)
        if where is not None:
            return ok
        for key in extra:
            self.report.add("leftover" if TMP_MARK in key else "orphan", key)
            self.orphans.append(key)
        return ok


def verify(
    url: str,
    deep: bool = False,
    fix: bool = False,
    progress: Callable[[str], None] | None = None,
    interval: float = 5.0,
    force: bool = False,
) -> VerifyReport:
    """Check every committed shard; with `fix`, then repair what was proven damaged — unless the
    damage looks like a wrong location or a store that answers empty listings rather than lost
    objects (most images missing), in which case nothing is changed and the report says why
    (`force` repairs anyway)."""
    output = Output(url)
    try:
        generation = json.loads(output.get(JOB))["fingerprint"]["generation"]
    except FileNotFoundError:
        raise StorageError(f"{output.url} holds no fleetgen job (no {JOB}).") from None
    except (ValueError, KeyError, TypeError) as err:
        raise StorageError(f"{output.key_url(JOB)} is not a fleetgen job record ({err}).") from None
    fmt = get_format(generation.get("output_format", "files"))
    if fix and live_lock(output):
        raise StorageError(
            f"{output.url} is in use by a running driver ({LOCK} has a fresh heartbeat): `--fix` only "
            "works on a job that is not running."
        )
    started = last = time.monotonic()
    report = VerifyReport(url=output.url, deep=deep)
    checker = _Checker(output, report, deep, fmt)
    if fix:  # first, complete commits whose objects were still being moved (their staging is whole)
        finish_attempts(output)
    committed = sorted(committed_shards(output))
    columns = ["id", "status", "image", "member", "sha256", "size", "num_frames", "audio_codec"]
    damaged: list[str] = []  # shards with missing or wrong images (their ids only: memory stays one shard's)
    for n, shard in enumerate(committed, 1):
        manifest = output.read_parquet(manifest_key(shard), columns)
        rows = [r for r in manifest.to_pylist() if r["status"] == "ok" and r.get("image")]
        report.shards += 1
        report.images += len(rows)
        if rows and not checker.check(shard, rows):
            damaged.append(shard)
        if progress and time.monotonic() - last >= interval:
            last = time.monotonic()
            progress(
                f"verify: {n}/{len(committed)} shards, {report.images} images, {sum(report.counts.values())} problems"
            )
    waiting, broken = _check_parts(output, set(committed), checker, columns)
    _stray(output, set(committed), report, checker.orphans, waiting)
    if fix:
        report.refused = _looks_wrong(report) if not force else None
        if report.refused is None:
            _repair(output, report, fmt, damaged, checker.orphans)
            for shard, first in broken.items():  # the part that is damaged, and those after it
                report.removed += _cut_chain(output, shard, first)
    report.seconds = round(time.monotonic() - started, 3)
    return report


def _looks_wrong(report: VerifyReport) -> str | None:
    """Why `--fix` should change nothing, or None. Lost objects are rare and few; when most of a job's
    images are missing, the location is more likely wrong (or the store lists nothing) than the
    images gone, and un-committing every shard would throw a good job away."""
    missing = report.counts["missing"]
    if report.images and missing * 2 > report.images:
        return (
            f"{missing} of {report.images} images are missing: that looks like a wrong location or a store "
            "that answers empty listings, not lost images. Nothing was changed; check the URL and the store, "
            "and pass `--fix --force` only if the images really are gone."
        )
    return None


def _repair(output: Output, report: VerifyReport, fmt: OutputFormat, damaged: list[str], orphans: list[str]) -> None:
    """Un-commit the damaged shards (their manifest and objects go, so a rerun redoes them), remove
    the orphans and leftovers."""
    for shard in damaged:
        output.remove(manifest_key(shard))
        report.uncommitted.append(shard)
        orphans += fmt.shard_objects(shard)
    for key in orphans:
        output.remove(key)
    report.removed = len(orphans)
    if report.uncommitted:
        output.remove(SUCCESS)


def _check_parts(
    output: Output, committed: set[str], checker: _Checker, columns: list[str]
) -> tuple[dict[str, set[str]], dict[str, int]]:
    """The parts of shards not yet committed, each part's images where they wait (its staging).
    Returns ({shard: the stagings its parts name}, {shard: the first row of its first damaged part})."""
    waiting, broken = {}, {}
    for shard in sorted(set(output.list(PARTS)) - committed):
        try:
            chain = read_chain(output, shard)
        except ShardError as err:
            checker.report.add("mismatch", f"{PARTS}/{shard}/", str(err))
            broken[shard] = 0
            continue
        waiting[shard] = {p.staging for p in chain}
        for part in chain:
            rows = [r for r in part.table().select(columns).to_pylist() if r["status"] == "ok" and r.get("image")]
            checker.report.images += len(rows)
            if rows and not checker.check(shard, rows, output.under(staging(shard, part.staging))):
                broken[shard] = part.first
                break
    return waiting, broken


def _cut_chain(output: Output, shard: str, first: int) -> int:
    """Remove a shard's parts from row `first` on, and their staging: a rerun makes those rows again."""
    removed = 0
    for part in read_parts_from(output, shard, first):
        output.remove(part_key(shard, part.first))
        output.remove(staging(shard, part.staging).rstrip("/"))
        removed += 2
    return removed


def read_parts_from(output: Output, shard: str, first: int) -> list:
    """The parts of `shard` from row `first` on, as stored (a broken chain's too)."""
    keys = [f"{PARTS}/{shard}/{n}" for n in output.list(f"{PARTS}/{shard}", ".parquet")]
    out = []
    for key, data in output.get_many(keys).items():
        try:
            part = part_of(data, output.key_url(key))
        except ShardError:
            output.remove(key)  # not a part at all
            continue
        if part.first >= first:
            out.append(part)
    return out


def _stray(
    output: Output, committed: set[str], report: VerifyReport, orphans: list[str], waiting: dict[str, set[str]]
) -> None:
    """Objects of shards that are not committed, staging and temporary files; the staging of a part
    (`waiting`: {shard: its parts' stagings}) is neither."""
    for name in output.list("data", temporary=True):
        shard = name.split(".", 1)[0]
        if TMP_MARK in name:
            report.add("leftover", f"data/{name}")
            orphans.append(f"data/{name}")
        elif shard not in committed:
            report.add("orphan", f"data/{name}", "its shard is not committed")
            orphans.append(f"data/{name}")
    for shard in output.list("images"):
        if shard not in committed:
            report.add("orphan", f"images/{shard}/", "its shard is not committed")
            orphans.append(f"images/{shard}")
    for name in output.list(SHARDS, temporary=True):
        if TMP_MARK in name:
            report.add("leftover", f"{SHARDS}/{name}")
            orphans.append(f"{SHARDS}/{name}")
    for shard in output.list(STAGING):
        if shard in waiting:
            for attempt in set(output.list(f"{STAGING}/{shard}")) - waiting[shard]:
                report.add("leftover", f"{STAGING}/{shard}/{attempt}/", "an attempt's staging")
                orphans.append(f"{STAGING}/{shard}/{attempt}")
            continue
        if output.find(f"{STAGING}/{shard}"):
            report.add("leftover", f"{STAGING}/{shard}/", "an attempt's staging")
        orphans.append(f"{STAGING}/{shard}")

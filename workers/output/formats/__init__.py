"""Output formats, as a registry (img2dataset's writers, fsspec's registry): each format owns its
object keys, its sink (what a worker writes as images are made), its read-back (what `verify`,
`status` and `report` read), and its words in the dataset card. `--output-format` choices come
from the registry; nothing guesses a format from a key. A new format is one new entry:

    class Mine(OutputFormat): ...
    register(Mine())

Formats from elsewhere load from the modules `FLEETGEN_PLUGINS` names (workers/output/plugins.py).

files       one object per image:                                OUT/images/<shard>/<id>.<ext>
webdataset  one tar per shard, <id>.<ext> + <id>.json members:   OUT/data/<shard>.tar
parquet     one Parquet file per shard, a row group per batch:   OUT/data/<shard>.parquet

Keys are deterministic. A sink writes under its attempt's staging prefix; the shard manifest (the
commit) is written by the worker after `close()`, and only the winning attempt's objects move to
their keys (workers/output/commit.py).
"""

from __future__ import annotations

import importlib
from typing import Protocol

import pyarrow as pa

from fleetgen.errors import ConfigError
from fleetgen.workers.output.made import Made
from fleetgen.workers.output.plugins import PLUGINS_ENV, load_plugins
from fleetgen.workers.output.storage import Output

__all__ = [
    "FORMATS",
    "Kept",
    "PLUGINS_ENV",
    "OutputFormat",
    "Sink",
    "ReadBack",
    "Unreadable",
    "format_names",
    "get_format",
    "open_sink",
    "register",
]


class Sink(Protocol):
    def add(self, made: list[Made], carried: pa.Table | None) -> list[tuple[str, str | None]]:
        """Store each image (`Made`, workers/output/made.py: its id, its encoded `data`, its sidecar
        record `meta` and its `companions`), with its row's carried input columns (`carried`, one row
        per image, or None); return `(object key, member)` for each."""

    def keep_existing(self) -> None:
        """A retry of a committed shard's error rows: put what the shard's object holds first."""

    def close(self) -> None:
        """Finish the shard's objects (after the last batch)."""

    def abort(self) -> None:
        """Give up: objects not yet complete do not appear."""


class Kept:
    """A sink that stores nothing: each image kept, encoded, by its record's id (`made`), for a caller that
    hands the bytes on itself (a Ray Data stage's rows: cluster/ray_data.py)."""

    def __init__(self):
        self.made: dict[str, Made] = {}

    def add(self, made: list[Made], carried: pa.Table | None) -> list[tuple[str | None, str | None]]:
        for m in made:
            self.made[m.record_id or m.id] = m
        return [(None, None)] * len(made)

    def keep_existing(self) -> None:
        raise NotImplementedError("a kept batch has no stored shard to keep")

    def close(self) -> None:
        pass

    def abort(self) -> None:
        self.made.clear()


class Unreadable(Exception):
    """A shard's object came back and is not what its format writes (damage, for `verify`)."""


ReadBack = dict[str, tuple[int | None, bytes | None]]  # image id -> (size, bytes when read); size None: missing


class OutputFormat:
    """One way of storing a shard's images. Subclasses set the attributes and the methods."""

    name: str = ""
    description: str = ""  # what `--output-format NAME` makes, for the CLI's help
    linked: bool = False  # each image is an object of its own: `report` links to it instead of embedding it
    dotless_ids: bool = False  # readers split `<id>.<ext>` at the first dot: ids must have none
    data_files: str | None = None  # the card's `datasets` data_files pattern, when the objects are a dataset
    carries_records: bool = False  # each image's record is stored beside it (not only in the manifest)

    def sink(self, output: Output, shard_id: str, image_format: str, carried: pa.Schema | None, prefix: str) -> Sink:
        raise NotImplementedError

    def shard_objects(self, shard_id: str) -> list[str]:
        """The keys (or prefixes) holding a shard's images: what `verify --fix` removes with a
        damaged shard."""
        raise NotImplementedError

    def object_prefixes(self, shard_id: str) -> list[str]:
        """Prefixes holding one object per image of the shard (and its companions): a commit that
        redoes the shard removes those its manifest no longer names. None where a shard's images
        share objects (a tar, a Parquet file), which the commit replaces whole."""
        return []

    def merge(self, output: Output, shard_id: str, pieces: list[tuple[str, list[dict]]], prefix: str) -> None:
        """Where a shard's images share objects: write them at `prefix` + their keys from the objects
        of `pieces` (each a staging prefix and the ok manifest rows, `id` and `member`, whose images it
        holds for the shard; it may hold others, which stay out), in order. A shard committed in parts
        (workers/output/parts.py) becomes one shard so. A format with neither this nor
        `object_prefixes` commits whole shards only."""
        raise NotImplementedError

    @property
    def commits_in_parts(self) -> bool:
        """Whether a shard of this format can commit in parts (`--commit-interval`)."""
        return bool(self.object_prefixes("shard")) or type(self).merge is not OutputFormat.merge

    def read_back(
        self, output: Output, shard_id: str, rows: list[dict], wanted: set[str] | None
    ) -> tuple[ReadBack, list[str]]:
        """What the store holds for a committed shard's ok rows (`rows`: manifest rows with `id`,
        `image`, `member`, `size`): {image id: (size, bytes)} with the bytes of the ids in `wanted`
        (None: every image) where reading them costs nothing extra, and the keys in the shard's
        space that no row names (orphans). Raises `Unreadable` for an object that is damaged."""
        raise NotImplementedError

    def finish(self, output: Output, counts: dict[str, dict]) -> None:
        """After a run, from every committed shard's counts (e.g. an index readers use)."""

    def how_to_load(self, url: str, shards: list[str]) -> list[str]:
        """The card's lines on reading the images (`shards`: committed shards with images)."""
        raise NotImplementedError


FORMATS: dict[str, OutputFormat] = {}


def register(fmt: OutputFormat) -> OutputFormat:
    FORMATS[fmt.name] = fmt
    return fmt


def format_names() -> list[str]:
    load_plugins()
    return list(FORMATS)


def get_format(name: str) -> OutputFormat:
    load_plugins()
    try:
        return FORMATS[name]
    except KeyError:
        raise ConfigError(f"`--output-format` must be one of {', '.join(FORMATS)}; got `{name}`.") from None


def open_sink(
    output: Output,
    shard_id: str,
    output_format: str,
    image_format: str,
    carried: pa.Schema | None = None,
    prefix: str = "",
    inputs: tuple[str, ...] = (),
) -> Sink:
    """`carried`: the input columns carried into each image's record, as typed in the input.
    Objects are written at `prefix` + their final key (an attempt's staging, workers/output/commit.py);
    `add` returns the final keys. `inputs`: the companions' columns (`--store-inputs`, a clip's poster
    and frames), for formats whose schema names them."""
    fmt = get_format(output_format)
    if inputs:
        return fmt.sink(output, shard_id, image_format, carried, prefix, inputs=inputs)
    return fmt.sink(output, shard_id, image_format, carried, prefix)


for _builtin in ("files", "webdataset", "parquet"):  # the built-in formats register themselves, in this order
    importlib.import_module(f"{__name__}.{_builtin}")

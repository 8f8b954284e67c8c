"""`webdataset`: one tar per shard, `OUT/data/<shard>.tar`, an `<id>.<ext>` and an `<id>.json`
member per image; a `wids` index (`OUT/wids-index.json`) of every committed shard after each run."""

from __future__ import annotations

import io
import json
import tarfile

import pyarrow as pa

from fleetgen.workers.output.formats import OutputFormat, ReadBack, Unreadable, register
from fleetgen.workers.output.layout import EXTENSIONS, WIDS_INDEX
from fleetgen.workers.output.storage import Output


def tar_key(shard_id: str) -> str:
    return f"data/{shard_id}.tar"


class WebDatasetSink:
    def __init__(
        self, output: Output, shard_id: str, image_format: str, carried: pa.Schema | None = None, prefix: str = ""
    ):
        self.output = output
        self.key = tar_key(shard_id)
        self.ext = EXTENSIONS[image_format]
        self.stream = output.open_write(prefix + self.key)
        self.tar = tarfile.open(fileobj=self.stream, mode="w|", format=tarfile.PAX_FORMAT)

    def _member(self, name: str, data: bytes) -> None:
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode = len(data), 0, 0o644  # mtime 0: same bytes on a retry
        self.tar.addfile(info, io.BytesIO(data))

    def add(self, made, carried=None):
        keys = []
        extra = carried.to_pylist() if carried is not None else [{}] * len(made)
        for m, columns in zip(made, extra, strict=True):
            self._member(f"{m.id}.{self.ext}", m.data)
            for name, value in m.companions.members():  # <id>.poster.jpg, <id>.input.png, <id>.mask.png
                self._member(f"{m.id}.{name}", value)
            # default=str: dates, decimals and the like become strings in the sample's JSON
            self._member(f"{m.id}.json", json.dumps({**m.meta, **columns}, sort_keys=True, default=str).encode())
            keys.append((self.key, f"{m.id}.{self.ext}"))
        return keys

    def keep_existing(self) -> None:
        with tarfile.open(fileobj=io.BytesIO(self.output.get(self.key)), mode="r:") as old:
            for info in old:
                self._member(info.name, old.extractfile(info).read())

    def close(self) -> None:
        self.tar.close()
        self.stream.close()

    def abort(self) -> None:
        Output.discard(self.stream)


def _copy_members(f, tar: tarfile.TarFile, stems: set[str]) -> None:
    with tarfile.open(fileobj=f, mode="r|") as old:
        for info in old:
            if info.name.split(".", 1)[0] in stems:
                tar.addfile(info, old.extractfile(info))


class WebDataset(OutputFormat):
    name = "webdataset"
    description = "a tar per shard, data/<shard>.tar (webdataset, wids)"
    dotless_ids = True
    data_files = "data/*.tar"
    carries_records = True

    def sink(self, output, shard_id, image_format, carried, prefix, inputs=()):
        return WebDatasetSink(output, shard_id, image_format, carried, prefix)

    def shard_objects(self, shard_id: str) -> list[str]:
        return [tar_key(shard_id)]

    def merge(self, output, shard_id, pieces, prefix) -> None:
        """One tar from the pieces' tars, member by member as they stream (`<id>.<ext>`, `<id>.json`
        and companions: ids have no dot here)."""
        stream = output.open_write(prefix + tar_key(shard_id))
        try:
            with tarfile.open(fileobj=stream, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                for source, rows in pieces:
                    stems = {r["member"].split(".", 1)[0] for r in rows if r["member"]}
                    if stems:
                        output.read_with(source + tar_key(shard_id), lambda f, s=stems: _copy_members(f, tar, s))
            stream.close()
        except BaseException:
            Output.discard(stream)
            raise

    def read_back(
        self, output: Output, shard_id: str, rows: list[dict], wanted: set[str] | None
    ) -> tuple[ReadBack, list[str]]:
        """The tar's headers, streamed; a member's bytes only when it is wanted."""
        ids = {r["member"]: r["id"] for r in rows}

        def members(f) -> dict:
            found = {}
            with tarfile.open(fileobj=f, mode="r:") as tar:
                for info in tar:  # headers only, unless the member is read
                    image_id = ids.get(info.name)
                    read = image_id is not None and (wanted is None or image_id in wanted)
                    found[info.name] = (info.size, tar.extractfile(info).read() if read else None)
            return found

        try:
            held = output.read_with(tar_key(shard_id), members)
        except FileNotFoundError:
            held = {}
        except tarfile.TarError as err:  # the bytes came, and they are not a tar: damage
            raise Unreadable(f"not a readable tar: {err}") from err
        return {r["id"]: held.get(r["member"], (None, None)) for r in rows}, []

    def finish(self, output: Output, counts: dict[str, dict]) -> None:
        """`OUT/wids-index.json`: every committed shard with its sample count, in the format
        `wids.ShardListDataset` reads (URLs relative to the index)."""
        shardlist = []
        for shard in sorted(counts):
            key = tar_key(shard)
            if counts[shard]["ok"]:
                shardlist.append({"url": key, "nsamples": counts[shard]["ok"], "filesize": output.size(key)})
        index = {
            "__kind__": "wids-shard-index-v1",
            "wids_version": 1,
            "name": output.url.rstrip("/").rsplit("/", 1)[-1],
            "shardlist": shardlist,
        }
        output.put(WIDS_INDEX, json.dumps(index, indent=2).encode())

    def how_to_load(self, url: str, shards: list[str]) -> list[str]:
        first, last = (shards[0], shards[-1]) if shards else ("shard-00000", "shard-00000")
        span = first.removeprefix("shard-") + ".." + last.removeprefix("shard-")
        return [
            "```python",
            "import webdataset as wds",
            f'ds = wds.WebDataset("{url}/data/shard-{{{span}}}.tar")'
            '.decode("pil")  # samples: png/jpg/webp (or mp4 + poster.jpg) + json',
            "",
            "import wids",
            f'ds = wids.ShardListDataset("{url}/wids-index.json")  # random access, sizes from the index',
            "```",
            "",
            *(
                ["From an object store, webdataset reads `pipe:` URLs (e.g. `pipe:aws s3 cp URL -`)."]
                if "://" in url and not url.startswith("file://")
                else []
            ),
        ]


WEBDATASET = register(WebDataset())

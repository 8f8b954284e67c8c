"""`files`: one object per image, `OUT/images/<shard>/<id>.<ext>`; a clip's poster frame beside
it, `<id>.poster.jpg`, and with `--store-frames` its frames, `<id>.frame-0000.png` ..."""

from __future__ import annotations

import pyarrow as pa

from fleetgen.workers.output.formats import OutputFormat, ReadBack, register
from fleetgen.workers.output.layout import beside, image_key, image_prefix, keeps
from fleetgen.workers.output.storage import Output


class FilesSink:
    def __init__(
        self, output: Output, shard_id: str, image_format: str, carried: pa.Schema | None = None, prefix: str = ""
    ):
        self.output, self.shard_id, self.image_format, self.prefix = output, shard_id, image_format, prefix

    def add(self, made, carried=None):
        keys = []
        for m in made:
            key = image_key(self.shard_id, m.id, self.image_format)
            for name, value in m.companions.members():  # a clip's poster: before the clip
                self.output.put(self.prefix + beside(key, name), value)
            self.output.put(self.prefix + key, m.data)
            keys.append((key, None))
        return keys

    def keep_existing(self) -> None:
        pass  # one object per image: the kept ones are not touched

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass  # each image object is whole; the attempt's staging is removed with them


class Files(OutputFormat):
    name = "files"
    description = "one object per image, images/<shard>/<id>.<ext>"
    linked = True

    def sink(self, output, shard_id, image_format, carried, prefix, inputs=()):
        return FilesSink(output, shard_id, image_format, carried, prefix)

    def shard_objects(self, shard_id: str) -> list[str]:
        return [image_prefix(shard_id)]

    def object_prefixes(self, shard_id: str) -> list[str]:
        return [image_prefix(shard_id)]

    def read_back(
        self, output: Output, shard_id: str, rows: list[dict], wanted: set[str] | None
    ) -> tuple[ReadBack, list[str]]:
        """One listing of the shard's prefix gives every size; bytes are read by who needs them."""
        sizes = output.sizes(image_prefix(shard_id))
        found = {r["id"]: (sizes.get(r["image"]), None) for r in rows}
        kept = keeps({r["image"] for r in rows})
        return found, sorted(k for k in sizes if not kept(k))

    def how_to_load(self, url: str, shards: list[str]) -> list[str]:
        return [
            f"Images are objects under `{url}/images/<shard>/<id>.<ext>`; the manifests name each image's object "
            "(column `image`)."
        ]


FILES = register(Files())

"""A throw-away per-row setting and a throw-away output format, added the way any is, from a module
named by `FLEETGEN_PLUGINS`: one entry in the field table, one in the format registry.

- `guidance_rescale`: a per-row setting (column `guidance_rescale`, option
  `--guidance-rescale-column`), a number in [0, 1] that changes pixels, passed to the pipeline as
  its `guidance_rescale` keyword, recorded per image and stored beside it.
- `jsonl`: one JSON-lines object per shard, `OUT/lines/<shard>.jsonl`, a line per image with its
  bytes in base64 (a sink, its keys, its read-back, its card lines)."""

from __future__ import annotations

import base64
import json

import pyarrow as pa

from fleetgen.workers.output.fields import Field, add_field
from fleetgen.workers.output.formats import OutputFormat, Unreadable, register
from fleetgen.workers.output.storage import Output

add_field(
    Field(
        "guidance_rescale",
        pa.float32(),
        "rescales the guided noise prediction (a test's setting)",
        role="guidance_rescale",
        kind="number",
        low=0,
        high=1,
        pixels=True,
        call_arg="guidance_rescale",
        sidecar=True,
    )
)


def lines_key(shard_id: str) -> str:
    return f"lines/{shard_id}.jsonl"


class LinesSink:
    def __init__(self, output: Output, shard_id: str, image_format: str, carried=None, prefix: str = ""):
        self.output, self.key = output, lines_key(shard_id)
        self.stream = output.open_write(prefix + self.key)

    def add(self, made, carried=None):
        extra = carried.to_pylist() if carried is not None else [{}] * len(made)
        for m, columns in zip(made, extra, strict=True):
            line = {**m.meta, **columns, "id": m.id, "b64": base64.b64encode(m.data).decode()}
            self.stream.write(json.dumps(line, sort_keys=True, default=str).encode() + b"\n")
        return [(self.key, None)] * len(made)

    def keep_existing(self) -> None:
        self.stream.write(self.output.get(self.key))

    def close(self) -> None:
        self.stream.close()

    def abort(self) -> None:
        Output.discard(self.stream)


class Lines(OutputFormat):
    name = "jsonl"
    description = "a JSON-lines file per shard, lines/<shard>.jsonl (a test's format)"
    carries_records = True

    def sink(self, output, shard_id, image_format, carried, prefix):
        return LinesSink(output, shard_id, image_format, carried, prefix)

    def shard_objects(self, shard_id: str) -> list[str]:
        return [lines_key(shard_id)]

    def read_back(self, output, shard_id, rows, wanted):
        try:
            text = output.get(lines_key(shard_id))
        except FileNotFoundError:
            return {r["id"]: (None, None) for r in rows}, []
        try:
            held = {line["id"]: base64.b64decode(line["b64"]) for line in map(json.loads, text.splitlines())}
        except (ValueError, KeyError) as err:
            raise Unreadable(f"not JSON lines: {err}") from err
        return {r["id"]: (len(held[r["id"]]), held[r["id"]]) if r["id"] in held else (None, None) for r in rows}, []

    def how_to_load(self, url, shards):
        return [f"Each line of `{url}/lines/<shard>.jsonl` is an image record with its bytes in `b64`."]


register(Lines())

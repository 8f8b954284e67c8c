"""The writer thread: encodes, hashes and stores a worker's images while the device makes the next
batch. At most `depth` batches wait for it: a slow store slows the pipeline (back-pressure) instead
of filling memory with decoded images. Errors surface in the caller."""

from __future__ import annotations

import hashlib
import io
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa

from fleetgen.workers.output.made import Made
from fleetgen.workers.output.video import VIDEO_FORMATS, encode_clip, poster

WRITE_AHEAD = 2  # batches handed to the writer thread before the pipeline waits: one being written, one queued
_ENCODE_ARGS = {
    "png": {"format": "PNG"},
    "jpeg": {"format": "JPEG", "quality": 95},
    "webp": {"format": "WEBP", "quality": 95},
}


def encode(image, image_format: str) -> bytes:
    buf = io.BytesIO()
    image.save(buf, **_ENCODE_ARGS[image_format])
    return buf.getvalue()


def encode_made(m: Made, media_format: str, crf: int, frames: bool = False) -> dict:
    """Encode an image, or a clip (workers/output/video.py: its first frame as the poster and, with
    `frames`, every frame as a PNG, as made), and the inputs stored beside it; the decoded pictures
    are let go. Returns what its records gain from the encoding (a clip's duration, codec...)."""
    info = {}
    if media_format in VIDEO_FORMATS:
        m.data, info = encode_clip(m.picture, media_format, crf)
        m.companions.poster = poster(m.picture)
        if frames:
            m.companions.frames = [encode(f, "png") for f in m.picture.frames]
    else:
        m.data = encode(m.picture, media_format)
    for role, picture in m.inputs:
        if role == "mask":
            m.companions.mask = encode(picture, "png")
        else:
            m.companions.inputs.append(encode(picture, "png"))
    m.picture, m.inputs = None, []  # the decoded pictures are not held longer than needed
    return info


def encode_and_store(
    sink, made: list[Made], records: dict, carried: pa.Table | None, media_format: str, crf: int = 18, frames=False
) -> None:
    """On the writer thread: encode and hash each image (or clip), then store the batch; each
    manifest record gains its key, member, digest and size. `carried`: the input columns kept
    beside each image, one row per entry of `made`."""
    for m in made:
        if m.picture is not None:
            info = encode_made(m, media_format, crf, frames)
            digest = hashlib.sha256(m.data).hexdigest()
            m.meta.update(sha256=digest, **info)
            m.record.update(sha256=digest, size=len(m.data), **info)
    kept = [i for i, m in enumerate(made) if m.data is not None]
    if kept:
        rows = carried.take(kept) if carried is not None else None
        stored = sink.add([made[i] for i in kept], rows)
        for i, (key, member) in zip(kept, stored, strict=True):
            records[made[i].record_id or made[i].id].update(made[i].record, image=key, member=member)
    for m in made:
        if m.data is None:
            records[m.record_id or m.id].update(m.record)


class Writer:
    """One background thread for a worker's writes; `depth` 0 writes inline, on the caller's thread
    (what bench/worker_overlap.py compares with)."""

    def __init__(self, depth: int = WRITE_AHEAD):
        self.depth, self.pending = depth, deque()
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fleetgen-writer")

    def submit(self, fn, *args) -> None:
        if self.depth == 0:
            fn(*args)
            return
        while len(self.pending) >= self.depth:
            self.pending.popleft().result()
        self.pending.append(self.pool.submit(fn, *args))

    def drain(self) -> None:
        """Wait for every batch handed over; raises the first error."""
        while self.pending:
            self.pending.popleft().result()

    def cancel(self) -> None:
        """Drop batches not started, wait for the one running; errors are ignored (giving up)."""
        while self.pending:
            future = self.pending.popleft()
            if not future.cancel():
                try:
                    future.result()
                except Exception:  # noqa: BLE001, S110 - the attempt is being abandoned anyway
                    pass

    def close(self) -> None:
        self.cancel()
        self.pool.shutdown(wait=True)

"""Input images: what a row's image and mask columns name, read once, checked, decoded and
resized to the image's size, ahead of the pipeline.

A column value is image bytes (Parquet binary), a `datasets` Image struct (`{bytes, path}`: the
bytes when present, else the path), a path or URL (local, `s3://`, `gs://`, `https://`, any fsspec
URL; relative paths are relative to the input file's folder), or a list of those for models that
take several reference images. Whatever cannot be read — a missing object, bytes that are not an
image, an image larger than `MAX_INPUT_SIDE` — makes that image an error row naming the row and the
source; the shard goes on.

`Prefetcher` fetches the inputs of the images a shard makes next on a few threads while the device
works, at most `window` images ahead (bounded memory; a slow store waits the pipeline, not memory).
"""

from __future__ import annotations

import hashlib
import io
import os
import posixpath
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from fleetgen.errors import StorageError, one_line
from fleetgen.workers.output.storage import guarded, url_to_fs, version_of

RESIZE_RULES = ("crop", "pad", "fit")  # `--resize`: how an input becomes the image's size
MAX_INPUT_SIDE = 16_384  # pixels a side; a larger input is an error row, never decoded
MAX_INPUT_BYTES = 256 * 2**20  # bytes of one input; more is an error row
FETCH_THREADS = 16  # concurrent reads: a store that answers in 200 ms still feeds 80 inputs/s
PREFETCH_IMAGES = 32  # images whose inputs are read ahead of the pipeline, at most


@dataclass(frozen=True)
class InputRef:
    """One input image as its row names it."""

    role: str  # image | mask
    source: str  # the path or URL, as resolved; `bytes` where the column held them
    data: bytes | None = None  # the bytes, where the column held them

    def describe(self) -> str:
        return "the bytes in its column" if self.data is not None else f"`{self.source}`"


@dataclass
class Loaded:
    """One input, read and decoded: the picture at the image's size and what its record says."""

    ref: InputRef
    picture: object  # PIL image, resized
    sha256: str  # of the bytes read (the content, not the name)
    width: int  # its own size, before resizing
    height: int
    version: str | None = None  # the object's size and ETag or mtime (workers/output/storage.py `version_of`)

    def record(self) -> dict:
        return {
            "role": self.ref.role,
            "source": self.ref.source,
            "sha256": self.sha256,
            "width": self.width,
            "height": self.height,
            "version": self.version,
        }


def _resolve(value: str, base: str) -> str:
    """A path as a row names it, against the input file's URL `base` (relative: beside the file)."""
    if "://" in value:
        return value
    if value.startswith("~"):
        return os.path.expanduser(value)
    if value.startswith("/"):
        return value
    folder = posixpath.dirname(base)
    return posixpath.normpath(posixpath.join(folder, value)) if "://" not in folder else f"{folder}/{value}"


def refs_of(value, role: str, base: str) -> tuple[list[InputRef], str | None]:
    """(the inputs a column value names, why it names none that can be read): bytes, a `datasets`
    Image struct, a path or URL, or a list of them. `base`: the input file's URL."""
    if value is None:
        return [], None
    if isinstance(value, list):
        refs = []
        for item in value:
            found, why = refs_of(item, role, base)
            if why:
                return [], why
            refs += found
        return refs, None
    if isinstance(value, bytes | bytearray | memoryview):
        return ([InputRef(role, "bytes", bytes(value))] if len(value) else []), None
    if isinstance(value, dict):
        if value.get("bytes"):
            return [InputRef(role, value.get("path") or "bytes", bytes(value["bytes"]))], None
        if value.get("path"):
            return [InputRef(role, _resolve(str(value["path"]), base))], None
        if "bytes" in value or "path" in value:
            return [], None  # a null image
        return [], f"{role} column holds a struct with neither `bytes` nor `path` ({', '.join(value)})"
    if isinstance(value, str):
        return ([InputRef(role, _resolve(value, base))] if value.strip() else []), None
    return [], f"{role} column holds a {type(value).__name__}, not an image"


def read_bytes(ref: InputRef) -> tuple[bytes, str | None]:
    """The input's bytes and its object's version: from its column (no version), or read through
    fsspec (retried as every read is)."""
    if ref.data is not None:
        return ref.data, None
    fs, path = url_to_fs(ref.source)

    def read() -> tuple[bytes, str]:
        info = fs.info(path)
        size = info.get("size")
        if size is not None and size > MAX_INPUT_BYTES:
            raise ValueError(f"{size} bytes; inputs may be at most {MAX_INPUT_BYTES // 2**20} MiB")
        with fs.open(path, "rb") as f:
            return f.read(MAX_INPUT_BYTES + 1), version_of(info)

    data, version = guarded("read", ref.source, read)
    if len(data) > MAX_INPUT_BYTES:
        raise ValueError(f"more than {MAX_INPUT_BYTES // 2**20} MiB; inputs may be at most that")
    return data, version


def fitted(picture, width: int, height: int, rule: str, mask: bool = False):
    """`picture` at exactly `width` x `height`: `crop` scales it to cover the size and cuts the
    middle (keeps its aspect, no borders); `pad` scales it to fit inside and pads the rest (black;
    a mask's padding is black too: kept); `fit` scales it to the size, aspect or not."""
    from PIL import Image as PILImage

    resample = PILImage.Resampling.NEAREST if mask else PILImage.Resampling.LANCZOS
    w, h = picture.size
    if (w, h) == (width, height):
        return picture
    if rule == "fit":
        return picture.resize((width, height), resample)
    scale = max(width / w, height / h) if rule == "crop" else min(width / w, height / h)
    size = (max(1, round(w * scale)), max(1, round(h * scale)))
    scaled = picture.resize(size, resample)
    if rule == "crop":
        left, top = (size[0] - width) // 2, (size[1] - height) // 2
        return scaled.crop((left, top, left + width, top + height))
    canvas = PILImage.new(scaled.mode, (width, height))
    canvas.paste(scaled, ((width - size[0]) // 2, (height - size[1]) // 2))
    return canvas


def load(ref: InputRef, width: int, height: int, rule: str) -> Loaded:
    """Read, hash, check and decode one input; raises ValueError (or StorageError, OSError) with
    the reason."""
    from PIL import Image as PILImage

    data, version = read_bytes(ref)
    digest = hashlib.sha256(data).hexdigest()
    try:
        opened = PILImage.open(io.BytesIO(data))  # reads the header only
    except PILImage.UnidentifiedImageError:
        raise ValueError(f"{len(data)} bytes that are not an image PIL can read") from None
    w, h = opened.size
    if max(w, h) > MAX_INPUT_SIDE:
        raise ValueError(f"{w}x{h} px; inputs may be at most {MAX_INPUT_SIDE} px a side")
    try:
        picture = opened.convert("L" if ref.role == "mask" else "RGB")  # decodes: a truncated file fails here
    except (OSError, SyntaxError) as err:
        raise ValueError(f"a damaged image ({one_line(err)})") from None
    return Loaded(ref, fitted(picture, width, height, rule, ref.role == "mask"), digest, w, h, version)


def load_all(refs: tuple[InputRef, ...], width: int, height: int, rule: str) -> tuple[list[Loaded], str | None]:
    """Every input of one image: (loaded, None), or ([], why the first that failed did)."""
    loaded = []
    for ref in refs:
        try:
            loaded.append(load(ref, width, height, rule))
        except FileNotFoundError:
            return [], f"input {ref.role} {ref.describe()} not found"
        except ValueError as err:
            return [], f"input {ref.role} {ref.describe()}: {err}"
        except (OSError, StorageError) as err:
            return [], f"input {ref.role} {ref.describe()}: {one_line(err)}"
    return loaded, None


class Prefetcher:
    """The inputs of `images` (in the order they will be made), read `window` images ahead on
    `threads` threads; the images of one row (`--images-per-prompt`) share one read. `take(image)`
    waits for one image's inputs and keeps the window full. Nothing is read for images without inputs."""

    def __init__(self, images: list, rule: str, window: int = PREFETCH_IMAGES, threads: int = FETCH_THREADS):
        self.rule, self.window = rule, window
        self.takers: dict[tuple, int] = {}  # what to read -> images still to take it
        for im in images:
            if im.inputs:
                self.takers[self._key(im)] = self.takers.get(self._key(im), 0) + 1
        self.pool = (
            ThreadPoolExecutor(max_workers=threads, thread_name_prefix="fleetgen-inputs") if self.takers else None
        )
        self.futures: dict[tuple, Future] = {}
        self.queue = deque(self.takers)

    @staticmethod
    def _key(image) -> tuple:
        return (image.inputs, image.look.width, image.look.height)

    def _fill(self) -> None:
        while self.queue and len(self.futures) < self.window:
            key = self.queue.popleft()
            self.futures[key] = self.pool.submit(load_all, *key, self.rule)

    def take(self, image) -> tuple[list[Loaded], str | None]:
        """The image's inputs, loaded (waiting for them), or the reason they could not be."""
        if not image.inputs:
            return [], None
        key = self._key(image)
        self._fill()
        if key not in self.futures:  # not in the window yet (the order moved on): read it now
            try:
                self.queue.remove(key)
            except ValueError:
                pass
            done: Future = Future()
            done.set_result(load_all(*key, self.rule))
            self.futures[key] = done
        result = self.futures[key].result()
        self.takers[key] = self.takers.get(key, 1) - 1
        if self.takers[key] <= 0:
            del self.futures[key]
        self._fill()
        return result

    def batch(self, images: list, records: dict) -> tuple[list, dict, dict]:
        """(the images whose inputs loaded, {id: their inputs}, {id: why not}) for one batch; each
        image's record gains its `inputs`, or its error."""
        inputs, unreadable = {}, {}
        for im in images:
            loaded, why = self.take(im)
            if why:
                unreadable[im.id] = why
                records[im.id].update(status="error", error=why)
            elif loaded:
                inputs[im.id] = loaded
                records[im.id]["inputs"] = [x.record() for x in loaded]
        return [im for im in images if im.id not in unreadable], inputs, unreadable

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.pool is not None:
            for future in self.futures.values():
                future.cancel()
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.futures.clear()

"""A model as files: a local pipeline directory or a hub id, what image sizes it takes, and a
cheap fingerprint of its weights. No torch here: the driver's commands that read a job's output
(`status`, `verify`) import this and stay quick."""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path

from fleetgen.latents import denoiser_patch, vae_scale

HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")  # org/name


def is_hub_id(model: str) -> bool:
    """Anything that is not an existing local path is a hub id."""
    return not Path(model).expanduser().exists()


def size_multiple(model: str) -> tuple[int, str] | None:
    """What image sizes must be a multiple of, from a local pipeline directory's configs (None for
    a hub id: it is checked when the worker loads it), with the reason: the pipeline's own rule (its
    family's `size_floor`, e.g. SD pipelines refuse sizes that are not multiples of 8 whatever their
    VAE) and the VAE scale times the denoiser's patch."""
    from fleetgen.workers.families.detect import identify_dir

    root = Path(model).expanduser()
    try:
        index = json.loads((root / "model_index.json").read_text())
        vae = json.loads((root / "vae" / "config.json").read_text())
    except (OSError, ValueError):
        return None
    floor = identify_dir(root)[0].size_floor
    scale = vae_scale(vae)
    denoiser = next((n for n in ("transformer", "unet") if n in index), None)
    patch = 1
    if denoiser:
        cls = index[denoiser][1] if isinstance(index[denoiser], list) else ""
        path = root / denoiser / "config.json"
        patch = denoiser_patch(cls or "", json.loads(path.read_text()) if path.exists() else {})
    reason = f"VAE scale {scale} x patch {patch}"
    if (scale * patch) % floor:
        reason += f"; {index.get('_class_name', 'the pipeline')} takes only multiples of {floor}"
    return math.lcm(scale * patch, floor), reason


WEIGHT_SAMPLES = 4  # blocks read from each weights file for its digest (first, last and two between)
WEIGHT_BLOCK = 1 << 16  # bytes per block


def weights_digest(directory: str) -> str:
    """A cheap fingerprint of a local pipeline directory's weights (or of one weights file, a
    scorer's head): every file's name and size,
    configs and indexes whole, each safetensors file's header (names, dtypes, shapes, offsets) and a
    few 64 KiB blocks of every weights file's data. Rebuilding or replacing the weights changes it
    (random or retrained weights differ in every block), at a few reads per file whatever its size."""
    root = Path(directory).expanduser().resolve()
    digest = hashlib.sha256()
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())  # a file: itself
    for path in files:
        rel = path.relative_to(root.parent if root.is_file() else root)
        if any(part.startswith(".") for part in rel.parts):
            continue  # caches and lock files of the hub client, editors' files
        size = path.stat().st_size
        digest.update(f"{rel.as_posix()}\0{size}\0".encode())
        with open(path, "rb") as f:
            if path.suffix in (".json", ".txt", ".model") or size <= WEIGHT_SAMPLES * WEIGHT_BLOCK:
                digest.update(f.read())
                continue
            start = 0
            if path.suffix == ".safetensors":
                header = int.from_bytes(f.read(8), "little")
                digest.update(f.read(min(header, 64 << 20)))
                start = 8 + header
            span = max(size - start - WEIGHT_BLOCK, 0)
            for i in range(WEIGHT_SAMPLES):
                f.seek(start + span * i // (WEIGHT_SAMPLES - 1))
                digest.update(f.read(WEIGHT_BLOCK))
    return digest.hexdigest()[:16]

"""The seed contract: a row's `seed` column when present, else a stable hash of (job seed, row id).

Noise comes from one CPU `torch.Generator` per image (workers/pipeline/calls.py `generators`), so an image does not depend on which worker,
how many workers, which offload plan or which retry made it.
"""

from __future__ import annotations

import hashlib

MAX_SEED = 2**63 - 1  # stored as int64 in manifests; torch generators take any such value


def derive_seed(job_seed: int, row_id: str) -> int:
    """Stable across processes, machines and Python versions (unlike `hash()`)."""
    digest = hashlib.blake2b(f"{job_seed}:{row_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & MAX_SEED

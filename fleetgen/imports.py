"""Loading a worker's stack with Python's cyclic garbage collector paused.

Importing torch, diffusers and transformers and building a pipeline allocates millions of objects
and almost no garbage, yet each allocation burst sets off a collection that walks everything made
so far: about a sixth of a worker's start-up CPU (1 s of 6 s on this repository's CI machine, a Ray
worker's start being nearly all imports). `paused_gc()` turns the collector off for such a stretch
and back on after it (as it was), collecting nothing it would have freed: reference counting still
frees every object that is not in a cycle, and the next collection finds the cycles.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def paused_gc() -> Iterator[None]:
    """The cyclic collector off for the block (imports, a model load), then as it was."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()

"""fleetgen: bulk image generation with diffusers on mixed-GPU Ray clusters.

One installed name. Its rooms are `fleetgen.jobs` (what a job is, its config, the driver, its records:
the folder jobs/), `fleetgen.workers` (one device's work: workers/), `fleetgen.offload` (fitting a pipeline
to a device: offload/) and `fleetgen.cluster` (Ray at the edge: cluster/), folders at the repository's top
that pyproject.toml's `package-dir` maps into this package (and the code below, in a source tree). This
package itself is two floors: under the rooms, the version, the exception tree, the settings machinery and
the few plain-data modules every room shares (`errors`, `units`, `settings`, `caches`, `attention`,
`latents`, `imports`: the garbage collector paused over a worker's start); over them, the Python API
(fleetgen/api.py), the command line (fleetgen/cli.py) and the Ray Data stage (fleetgen/ray_data.py), which
no room imports. Nothing here imports torch or Ray at import time.

The Python API mirrors the commands (fleetgen/api.py): `fleetgen.run`, `fleetgen.plan`,
`fleetgen.status`, `fleetgen.verify`, `fleetgen.report`, `fleetgen.score`, `fleetgen.calibrate`,
`fleetgen.demo`, `fleetgen.tiny_model`; `fleetgen.warm_workers()` keeps workers up between the runs made
inside it. The command line (fleetgen/cli.py) is a thin layer over it; the settings a job takes are
declared once (fleetgen/settings.py).
"""

import os as _os

from fleetgen.errors import ClusterError, ConfigError, FleetgenError, InputError, OffloadError, ShardError, StorageError

__version__ = "0.1.0"

# In a source tree the rooms are folders beside this package (docs/architecture.md: the repository's top level);
# installed from a wheel, setuptools' `package-dir` puts them inside it. A tree used as it is — a
# `ray job submit --working-dir .` upload, a GPU machine running bench/gpu_check.py from a copy —
# imports its own rooms, never those of another copy installed on the machine.
_HERE = _os.path.dirname(_os.path.abspath(__file__))
_TREE = _os.path.dirname(_HERE)
if not _os.path.isdir(_os.path.join(_HERE, "jobs")) and all(
    _os.path.isfile(_os.path.join(_TREE, room, "__init__.py")) for room in ("jobs", "workers", "offload", "cluster")
):
    __path__.append(_TREE)

from fleetgen.api import calibrate, demo, plan, report, run, score, status, tiny_model, verify, warm_workers  # noqa: E402 - after the rooms are reachable

__all__ = [
    "ClusterError",
    "ConfigError",
    "FleetgenError",
    "InputError",
    "OffloadError",
    "ShardError",
    "StorageError",
    "__version__",
    "calibrate",
    "demo",
    "plan",
    "report",
    "run",
    "score",
    "status",
    "tiny_model",
    "verify",
    "warm_workers",
]

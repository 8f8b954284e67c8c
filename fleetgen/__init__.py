"""fleetgen's shared leaf: the version and the exception tree, importable from every room.

The rooms themselves are top-level packages (`offload`, `workers`, `cluster`, `jobs`); this package
holds only what all of them need and imports none of them.
"""

from fleetgen.errors import ClusterError, ConfigError, FleetgenError, InputError, OffloadError, ShardError, StorageError

__version__ = "0.1.0"

__all__ = [
    "ClusterError",
    "ConfigError",
    "FleetgenError",
    "InputError",
    "OffloadError",
    "ShardError",
    "StorageError",
    "__version__",
]

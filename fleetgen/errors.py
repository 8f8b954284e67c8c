"""Every error fleetgen raises on purpose, as one tree.

    FleetgenError
    ├── ConfigError (ValueError)   invalid option, config file or generation setting
    ├── InputError                 the prompt dataset: missing, not Parquet, wrong columns
    ├── OffloadError               nothing fits the device, or a refused offload combination
    ├── StorageError               the output location: unreadable, unwritable, another job there
    ├── ShardError                 one shard could not be generated or committed
    └── ClusterError               Ray: cannot connect, no resources, workers keep dying

Messages say what is wrong (the parameter and value), the rule, then the fix.
"""


class FleetgenError(Exception):
    """Base of every error fleetgen raises deliberately."""


class ConfigError(FleetgenError, ValueError):
    """An option, config file or generation setting is invalid."""


class InputError(FleetgenError):
    """The input dataset cannot be used as given."""


class OffloadError(FleetgenError):
    """The pipeline cannot be fitted to the device as asked."""


class StorageError(FleetgenError):
    """The output location cannot be read or written, or holds something else."""


class ShardError(FleetgenError):
    """A shard failed as a whole."""


class ClusterError(FleetgenError):
    """Ray could not be reached or could not run the workers."""


def one_line(err: BaseException) -> str:
    """`TypeName: first line of the message`, for error messages that quote another library's error."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"

"""Extensions from elsewhere: the modules `FLEETGEN_PLUGINS` names (comma-separated, importable
on the driver and on every worker; the driver forwards the variable to its workers). A plugin
module adds what it brings when imported: output formats (`workers.formats.register`) and per-row
fields (`workers.fields.add_field`). They load when the field table first loads, so the column
options a field adds exist before `JobConfig` is built."""

from __future__ import annotations

import importlib
import os

from fleetgen.errors import ConfigError

PLUGINS_ENV = "FLEETGEN_PLUGINS"
_loaded: set[str] = set()


def load_plugins() -> None:
    """Import each module `FLEETGEN_PLUGINS` names, once."""
    for module in filter(None, (m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(","))):
        if module not in _loaded:
            _loaded.add(module)
            try:
                importlib.import_module(module)
            except ImportError as err:
                _loaded.discard(module)
                raise ConfigError(f"`{PLUGINS_ENV}` names `{module}`, which cannot be imported: {err}") from err

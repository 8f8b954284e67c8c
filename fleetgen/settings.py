"""Settings, each declared once: as a field of the record that carries it, with `setting(...)`.

A job's records nest — `JobConfig` (jobs/config.py) holds the weights' `Source`, the
`GenerationSettings` every image shares and each worker's `Fit` (workers/spec.py), and the
input's column names — and every field declared with `setting()` is a row of one table: its name
(the keyword of `fleetgen.run`, the key of a TOML file, `--name` on the command line), its type
(the annotation), default, help, and where it applies (`job`, each `worker`'s own, or a per-`row`
column) and whether it is in the job's fingerprint. `table(JobConfig)` walks the records into those
rows; the command line's options (`add_options`), the TOML file's coercion (`coerce`), the API's
accepted keywords (`check_names`), building a record from flat options (`build`, `with_values`) and
docs/reference/options.md are all made from them. Adding a setting is one field with
its `setting(...)` in the record that carries it, plus the code that uses it.

Plain data: this module imports no room, no torch and no Ray.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fleetgen.errors import ConfigError

_SETTING = "fleetgen.setting"  # field metadata keys
_NESTED = "fleetgen.nested"
_COLUMNS = "fleetgen.columns"
_RECORD = "fleetgen.record"


@dataclass(frozen=True)
class Declared:
    """What `setting()` attaches to a field; unset parts come from the record that nests it."""

    help: str | Callable[[], str]  # a callable: read when the parser is made (it lists what plugins add)
    group: str | None = None  # the `--help` group the option is listed in
    scope: str | None = None  # job (one value for every worker) | worker (each worker's own) | row (an input column)
    fingerprint: bool | None = None  # part of the job's fingerprint: a resume must match it
    flags: tuple[str, ...] = ()  # command-line spellings (default `--name-with-dashes`)
    aliases: tuple[str, ...] = ()  # other keyword and TOML names of the same setting
    choices: Sequence[str] | Callable[[], Sequence[str]] | None = None  # a callable: read when the parser is made
    metavar: str | None = None
    shown: Callable[[Any], Any] | None = None  # the value as job.json's `config` and the docs show it
    cli: bool = True  # False: a keyword and a TOML key only
    written: str | None = None  # typed as text of this kind, parsed by the record (`size`: `24GiB`)
    stage: str | None = None  # why a Ray Data stage (`fleetgen.ray_data.generate`) has no such setting
    at_least: float | None = None  # the smallest value it takes (a number setting)
    at_most: float | None = None  # the largest
    more_than: float | None = None  # every value it takes is more than this
    plan: bool = False  # `fleetgen plan` takes it too (a job's setting a plan depends on: jobs/planning.py)


def setting(default: Any, help: str | Callable[[], str], **how: Any) -> Any:
    """A field that is a setting: `steps: int | None = setting(None, "denoising steps ...")`."""
    return field(default=default, metadata={_SETTING: Declared(help, **how)})


def nested(cls: type, *, group: str, scope: str, fingerprint: bool, factory: Callable[[], Any] | None = None) -> Any:
    """A field holding a record of settings; what its settings do not say of themselves comes from
    here. `factory`: the record's default where it is not `cls()` (its settings' defaults are its)."""
    how = {"group": group, "scope": scope, "fingerprint": fingerprint}
    return field(default_factory=factory or cls, metadata={_NESTED: how, _RECORD: cls})


def columns(rows: Callable[[], list[Row]], defaults: Callable[[], dict[str, str]]) -> Any:
    """A field holding `{role: input column}`: one setting per role, `rows()` (`<role>_column`)."""
    return field(default_factory=defaults, metadata={_COLUMNS: rows})


@dataclass(frozen=True, kw_only=True)
class Row(Declared):
    """One setting: a row of the table — what its `setting()` declares, with what the record nesting it
    said for the rest (its group, scope and fingerprint, all set here), and where it lives."""

    name: str  # the keyword, the TOML key, `--name-with-dashes`
    path: tuple[str, ...]  # where its value lives in the top record, e.g. ("generation", "steps")
    type: str  # the annotation, e.g. "int | None"
    default: Any

    @property
    def typed(self) -> str:
        """What a user types for it: `int`, `float`, `bool`, `str` (also the records parsed from text,
        and sizes), `tuple` (repeatable text)."""
        base = self.type.replace(" | None", "")
        if base.startswith("tuple"):
            return "tuple"
        return base if base in ("int", "float", "bool") and not self.written else "str"

    @property
    def option(self) -> str:
        """How error messages name it: `--max-batch`."""
        return self.flags[0] if self.flags else f"--{self.name.replace('_', '-')}"

    @property
    def text(self) -> str:
        return self.help() if callable(self.help) else self.help

    @property
    def choice_list(self) -> list[str] | None:
        return None if self.choices is None else list(self.choices() if callable(self.choices) else self.choices)

    def show(self, value: Any) -> Any:
        """The value as job.json's `config` holds it, and the docs print its default."""
        return value if value is None or self.shown is None else self.shown(value)


def table(cls: type, **defaults: Any) -> list[Row]:
    """Every setting of record `cls` and of the records it nests, in declaration order; `defaults`:
    the group, scope and fingerprint of `cls`'s own settings where they do not say."""
    rows = _walk(cls, (), defaults)
    seen: dict[str, Row] = {}
    for row in rows:
        for name in (row.name, *row.aliases):
            if name in seen:
                raise TypeError(f"{cls.__name__}: two settings named `{name}` ({seen[name].path} and {row.path})")
            seen[name] = row
    return rows


def _walk(cls: type, path: tuple[str, ...], inherited: dict, defaults: Any = None) -> list[Row]:
    """`defaults`: the record's default instance where it nests in another (its values are the defaults)."""
    hints = {f.name: f.type for f in dataclasses.fields(cls)}
    out: list[Row] = []
    for f in dataclasses.fields(cls):
        if _NESTED in f.metadata:
            out += _walk(f.metadata[_RECORD], (*path, f.name), f.metadata[_NESTED], f.default_factory())
        elif _COLUMNS in f.metadata:
            out += [dataclasses.replace(r, path=(*path, f.name, *r.path)) for r in f.metadata[_COLUMNS]()]
        elif _SETTING in f.metadata:
            d: Declared = f.metadata[_SETTING]
            pick = {k: getattr(d, k) if getattr(d, k) is not None else inherited.get(k) for k in _INHERITED}
            if any(v is None for v in pick.values()):
                raise TypeError(
                    f"setting `{f.name}` of {cls.__name__} says no {[k for k, v in pick.items() if v is None]}"
                )
            declared = {k.name: getattr(d, k.name) for k in dataclasses.fields(Declared)}
            default = f.default if defaults is None else getattr(defaults, f.name)
            row = {**declared, **pick, "name": f.name, "path": (*path, f.name), "type": str(hints[f.name])}
            out.append(Row(**row, default=default))
    return out


_INHERITED = ("group", "scope", "fingerprint")


def check_value(row: Row, value: Any) -> None:
    """`value` is one the setting declares (its choices, its bounds), else `ConfigError` in its option's
    words: the one check of every value that enters, from the command line, a TOML file, the API or a
    stage (`build` and `with_values` run it). Rules across settings are jobs/validate.py's."""
    if value is None:
        return
    if row.typed in ("int", "float") and (isinstance(value, bool) or not isinstance(value, int | float)):
        raise ConfigError(f"`{row.option}` must be a number, got `{value!r}`.")
    if isinstance(value, float) and math.isnan(value):  # it passes every bound: `nan < 0` is False
        raise ConfigError(f"`{row.option}` must be a number, got `nan`.")
    if row.typed == "int" and isinstance(value, float) and not value.is_integer():
        raise ConfigError(f"`{row.option}` must be a whole number, got `{value}`.")
    choices = row.choice_list
    if choices is not None:
        for v in value if row.typed == "tuple" and isinstance(value, tuple | list) else (value,):
            if v not in choices:
                close = difflib.get_close_matches(str(v), [str(c) for c in choices], n=1)
                hint = f" Did you mean `{close[0]}`?" if close else ""
                raise ConfigError(f"`{row.option}` must be one of {', '.join(map(str, choices))}; got `{v}`.{hint}")
    if row.at_least is None and row.at_most is None and row.more_than is None:
        return
    rule = bounds_text(row)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"`{row.option}` must be a number, {rule}; got `{value!r}`.")
    if (
        (row.at_least is not None and value < row.at_least)
        or (row.more_than is not None and value <= row.more_than)
        or (row.at_most is not None and value > row.at_most)
    ):
        raise ConfigError(f"`{row.option}` must be {rule}, got `{value}`.")


def bounds_text(row: Row) -> str:
    """The bounds as a sentence says them: `1 or more`, `0 to 1`, `more than 0 and at most 240` ("": none)."""

    def n(x: float) -> str:
        return f"{x:g}"

    low = n(row.at_least) if row.at_least is not None else None
    if low is not None and row.at_most is not None:
        return f"{low} to {n(row.at_most)}"
    parts = [f"{low} or more"] if low is not None else []
    if row.more_than is not None:
        parts.append(f"more than {n(row.more_than)}")
    if row.at_most is not None:
        parts.append(f"at most {n(row.at_most)}")
    return " and ".join(parts)


def names(rows: list[Row]) -> dict[str, Row]:
    """{name or alias: row}."""
    return {n: r for r in rows for n in (r.name, *r.aliases)}


def canonical(values: Mapping[str, Any], rows: list[Row]) -> dict[str, Any]:
    """`values` by each setting's own name (an alias such as `workers` becomes `max_workers`); a
    setting given under two of its names is refused."""
    known, out, given_as = names(rows), {}, {}
    for name, value in values.items():
        row = known[name]
        if row.name in out and value != out[row.name]:
            raise ConfigError(
                f"`{given_as[row.name]}` ({out[row.name]}) and `{name}` ({value}) name the same setting "
                f"(`{row.option}`): pass one."
            )
        out[row.name], given_as[row.name] = value, name
    return out


def check_names(given: Sequence[str], rows: list[Row], command: str) -> None:
    """A name the command does not take is refused, naming the closest one it has."""
    known = list(names(rows))
    for name in given:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" Did you mean `{close[0]}`?" if close else f" Its options: {', '.join(sorted(known))}."
            raise ConfigError(f"`{command}` has no option `{name}`.{hint}")


def build(cls: type, values: Mapping[str, Any], **fixed: Any) -> Any:
    """A `cls` from flat settings (`{"steps": 4, "max_batch": 2}`), each put where its row says;
    `fixed`: `cls`'s own fields given as they are (a record built elsewhere, a name), the flat
    settings over them."""
    return _replace(cls(**fixed), _by_path(cls, values))


def with_values(record: Any, values: Mapping[str, Any]) -> Any:
    """`record` with flat settings replaced where their rows say (`dataclasses.replace`, nested)."""
    return _replace(record, _by_path(type(record), values))


def value_at(record: Any, row: Row) -> Any:
    value = record
    for part in row.path:
        value = value[part] if isinstance(value, Mapping) else getattr(value, part)
    return value


def _by_path(cls: type, values: Mapping[str, Any]) -> dict[tuple[str, ...], Any]:
    rows = names(_fields_and_settings(cls))
    unknown = [n for n in values if n not in rows]
    if unknown:
        raise ConfigError(f"{cls.__name__} has no setting `{unknown[0]}`.")
    out = {}
    for n, v in canonical(values, list(rows.values())).items():
        check_value(rows[n], v)
        out[rows[n].path] = v
    return out


def _fields_and_settings(cls: type) -> list[Row]:
    """The settings, and every other field of the nested records (a WorkerSpec's `threads`, a
    Fit's resolved `plan_size`) by its own name."""
    rows = table(cls, group="", scope="", fingerprint=False)
    taken = {r.name for r in rows}
    return rows + [
        Row(help="", group="", scope="", fingerprint=False, name=f.name, path=path, type="", default=None)
        for f, path in _plain_fields(cls, ())
        if f.name not in taken
    ]


def _plain_fields(cls: type, path: tuple[str, ...]):
    for f in dataclasses.fields(cls):
        if _NESTED in f.metadata:
            yield from _plain_fields(f.metadata[_RECORD], (*path, f.name))
        elif _SETTING not in f.metadata and _COLUMNS not in f.metadata:
            yield f, (*path, f.name)


def _replace(record: Any, by_path: dict[tuple[str, ...], Any]) -> Any:
    changes = {}
    for f in dataclasses.fields(record):
        mine = {p[1:]: v for p, v in by_path.items() if p[0] == f.name}
        if not mine:
            continue
        current = getattr(record, f.name)
        if _NESTED in f.metadata:
            changes[f.name] = _replace(current, mine)
        elif _COLUMNS in f.metadata:
            changes[f.name] = {**current, **{p[0]: v for p, v in mine.items()}}
        else:
            changes[f.name] = mine[()]
    return dataclasses.replace(record, **changes)


# TOML: what a key's value must be, by the setting's annotation. Records parsed from a string
# (`QuantizeSpec`, ...) take the string; a repeatable option takes a list of strings.
_TOML_TYPES = {"int": int, "float": (int, float), "str": str, "bool": bool}


def coerce(row: Row, value: Any, source: str) -> Any:
    """Type-check one setting read from a TOML file `source` (the command line's are typed by argparse)."""
    typed = row.typed
    repeated = typed == "tuple"
    wanted = list if repeated else _TOML_TYPES[typed]
    if (
        (isinstance(value, bool) and typed != "bool")
        or not isinstance(value, wanted)
        or (repeated and not all(isinstance(v, str) for v in value))
    ):
        shown = "a list of strings" if repeated else row.written or typed
        raise ConfigError(f"`{row.name}` in {source} must be {shown}, got `{value!r}`.")
    if repeated:
        return tuple(value)
    return float(value) if typed == "float" else value


def add_options(parser: argparse.ArgumentParser, rows: list[Row], titles: Mapping[str, str]) -> dict[str, Any]:
    """One option per row that has one, in argument groups titled by `titles` ({group: title}, in
    that order). Every default is None: an unset option falls through (to a TOML file, then to the
    record's default, which its help says). Returns the groups, by their key in `titles`."""
    groups = {g: parser.add_argument_group(title) for g, title in titles.items()}
    for row in rows:
        if row.cli:
            _add(groups[row.group], row)
    return groups


def _add(group, row: Row) -> None:
    typed = row.typed
    text, shown = row.text, row.show(row.default)
    if shown not in (None, "", (), []) and "default" not in text:  # the default the table holds, said once
        text += f" (default {str(shown).lower() if isinstance(shown, bool) else shown})"
    kw: dict[str, Any] = {"dest": row.name, "help": text.replace("%", "%%"), "default": None}  # argparse formats %
    if typed == "bool":
        kw["action"] = "store_true"
    elif typed == "tuple":
        kw["action"] = "append"
    elif typed in ("int", "float"):
        kw["type"] = int if typed == "int" else float
    if row.choice_list is not None:
        kw["choices"] = row.choice_list
    if row.metavar:
        kw["metavar"] = row.metavar
    group.add_argument(*(row.flags or (row.option,)), **kw)

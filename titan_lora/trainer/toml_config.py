"""titan_lora's own config parse: a TOML file plus `--section.key value` overrides into the nested dataclass
of a schema, field by field (no torchtitan, no tyro).

The schema is an argument (today torchtitan 0.2.2's JobConfig merged with titan_lora's sections), so a new
torchtitan changes the schema, not this parser. The override spellings are the ones torchtitan 0.2.2's
ConfigManager (tyro plus its comma rule for `list[str]`) took: `--a.b v`, `--a.b=v`, `-` for `_` in names,
`--a.flag` / `--a.no-flag` for true/false keys, `a,b` for a `list[str]` key, `None` for a key that may be
None, and in a free-form table (`[task]`) only the keys its TOML sets, typed by their TOML values.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import tomllib
import types
from collections.abc import Callable
from typing import Any, Literal, Union, get_args, get_origin

from titan_lora.config import ConfigError

HELP_FLAGS = ("-h", "--help")
Refused = Callable[[tuple[str, ...]], str | None] | None
"""Why a section (`(name,)`) or key (`(section, key)`) that the schema lacks is refused; None: unknown."""


def fields(cls: type) -> dict[str, dataclasses.Field]:
    """A dataclass's fields by name."""
    return {f.name: f for f in dataclasses.fields(cls)}


def did_you_mean(name: str, known: list[str], what: str) -> str:
    """The closest known name, else the list of them."""
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}?" if close else f"known {what}: {', '.join(sorted(known))}"


def field_default(f: dataclasses.Field) -> Any:  # any key's value
    """A field's default value (None when it has none)."""
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None


def _is_union(tp: Any) -> bool:
    return get_origin(tp) in (Union, types.UnionType)


def _is_table(tp: Any) -> bool:
    return tp is dict or get_origin(tp) is dict


def table_array_item(tp: Any) -> type | None:
    """The dataclass of an array of tables (`list[Adapter]`: `[[adapters]]`), else None."""
    args = get_args(tp)
    return args[0] if get_origin(tp) is list and args and dataclasses.is_dataclass(args[0]) else None


def type_fits(value: Any, tp: Any) -> bool:
    """Whether a TOML value suits a field annotated `tp` (an int suits a float; a bool suits no number)."""
    origin, args = get_origin(tp), get_args(tp)
    if _is_union(tp):
        return any(type_fits(value, a) for a in args)
    if origin is Literal:
        return value in args
    if tp is type(None):  # TOML has no null: a key annotated `X | None` takes an X
        return False
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if tp is list or origin is list:
        return isinstance(value, list) and (not args or all(type_fits(v, args[0]) for v in value))
    if _is_table(tp) or dataclasses.is_dataclass(tp):
        return isinstance(value, dict)
    return True  # a type TOML cannot spell (Any, None): left to the field's own checks


def type_words(tp: Any) -> str:
    """A field's type as a user reads it: "an integer", "a list of strings", "one of 'a', 'b'"."""
    origin, args = get_origin(tp), get_args(tp)
    if _is_union(tp):
        return " or ".join(type_words(a) for a in args if a is not type(None))
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is list and args and get_origin(args[0]) is Literal:
        return "a list of " + ", ".join(repr(a) for a in get_args(args[0]))
    if tp is list or origin is list:
        return "a list" + (f" of {type_words(args[0]).split(' ', 1)[-1]}s" if args and args[0] is not Any else "")
    words = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    return words.get(tp, "a table" if _is_table(tp) or dataclasses.is_dataclass(tp) else str(tp))


def toml_literal(value: Any) -> str:
    """`value` as it is written in TOML."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_literal(v) for v in value) + "]"
    return repr(value)


_TOML_POSITION = re.compile(r"^(?P<msg>.*) \(at line (?P<line>\d+), column (?P<col>\d+)\)$")


def read_toml(path: str) -> dict:
    """The TOML file at `path`; a missing file or a syntax error is a ConfigError naming file, line and column."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError([f"--job.config_file {path!r}: no such file"]) from None
    except OSError as err:  # a directory, a file this user may not read
        raise ConfigError([f"--job.config_file {path!r} cannot be read ({err.strerror}); name a TOML file"]) from None
    except tomllib.TOMLDecodeError as err:
        m = _TOML_POSITION.match(str(err))
        where = f"{path}:{m['line']}:{m['col']}" if m else path
        raise ConfigError([f"{where}: TOML syntax error: {m['msg'] if m else err}"]) from None


def _option_name(arg: str) -> str:
    """`--section-x.key-y=v` -> `section_x.key_y` (tyro takes `-` and `_` alike in names)."""
    return arg[2:].split("=", 1)[0].replace("-", "_")


def config_path(argv: list[str]) -> str | None:
    """The TOML file that `--job.config_file PATH` (or `=PATH`) names; None without one."""
    for i, arg in enumerate(argv):
        if arg.startswith("--") and _option_name(arg) == "job.config_file":
            return arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else None)
    return None


# ---- what a key is: its annotation, where a free-form table's keys take the type of their TOML value ----

def _inferred(value: Any) -> Any:
    """The annotation tyro gave a free-form table's key from its TOML value (a list's items: their one
    type, ints and floats mixed: either, else strings); a nested table stays a table."""
    if isinstance(value, dict):
        return dict
    if not isinstance(value, list):
        return type(value)
    kinds = {type(v) for v in value}
    if len(kinds) == 1 and kinds <= {bool, int, float, str} and str not in kinds:
        return list[kinds.pop()]
    return list[int | float] if kinds == {int, float} else list[Any]  # list[Any]: strings, never split at commas


@dataclasses.dataclass(frozen=True)
class _Key:
    """One override's key, found in the schema: where it goes and its annotation ("no": a negated flag)."""

    path: tuple[str, ...]
    tp: Any

    @property
    def where(self) -> str:
        """`[section] key` (`[training.dataloader] num_workers`) as the TOML writes it."""
        return _where(list(self.path))


def _find_key(name: str, schema: type, toml: dict, refused: Refused = None) -> _Key | str:
    """The key that `name` (`section.key`, `section.sub.key`, `section.no_flag`) means, or the error."""
    tp, given, path = schema, toml, []
    for part in name.split("."):
        if table_array_item(tp) is not None:
            return f"[[{'.'.join(path)}]] tables are set in the TOML only: edit them there"
        if dataclasses.is_dataclass(tp):
            known = {n: f.type for n, f in fields(tp).items()}
        elif _is_table(tp):  # free-form ([task]): an override may change only what its TOML sets
            known = {n: _inferred(v) for n, v in given.items()} if isinstance(given, dict) else {}
        else:
            return f"{_where(path)} is not a table: write --{'.'.join(path)} VALUE"
        if part not in known and part.startswith("no_") and known.get(part[3:]) is bool:
            return _Key((*path, part[3:]), "no")  # the negated flag: --section.no-flag
        if part not in known:
            return (refused and refused((*path, part))) or _unknown(path, part, list(known), _is_table(tp))
        tp, given = known[part], given.get(part, {}) if isinstance(given, dict) else {}
        path.append(part)
    if dataclasses.is_dataclass(tp) or _is_table(tp):
        return f"[{'.'.join(path)}] is a table: override its keys, --{'.'.join(path)}.KEY VALUE"
    return _Key(tuple(path), tp)


def _where(path: list[str]) -> str:
    return f"[{'.'.join(path[:-1])}] {path[-1]}"


def _unknown(path: list[str], part: str, known: list[str], free_form: bool) -> str:
    if not path:
        return f"[{part}] is not a config section; {did_you_mean(part, known, 'sections')}"
    if free_form:
        return (f"[{'.'.join(path)}] sets no {part!r} in the TOML; an override changes a key that the TOML's "
                f"[{'.'.join(path)}] sets: add `{part} = ...` there")
    return f"[{'.'.join(path)}] has an unknown key {part!r}; {did_you_mean(part, known, 'keys')}"


# ---- values: one argument (most keys), none (a true/false flag) or several (a list of non-strings) ----

def _takes_many(tp: Any) -> bool:
    """Whether a key takes the arguments that follow it (tyro's nargs="*"): a list of anything but
    strings, whose `list[str]` takes one argument split at commas (torchtitan's rule)."""
    members = get_args(tp) if _is_union(tp) else (tp,)
    lists = [m for m in members if get_origin(m) is list]
    return bool(lists) and lists[0] != list[str]


def _parse_one(text: str, tp: Any) -> Any:
    """One argument as a value of `tp`, as tyro read it; ValueError when it is none."""
    origin, args = get_origin(tp), get_args(tp)
    if _is_union(tp):
        if type(None) in args and text == "None":
            return None
        for member in (a for a in args if a is not type(None)):
            try:
                return _parse_one(text, member)
            except ValueError:
                continue
        raise ValueError(text)
    if origin is Literal:
        for choice in args:
            if str(choice) == text:
                return choice
        raise ValueError(text)
    if tp == list[str]:
        return text.split(",")
    if tp is bool:  # an item of a list: tyro's spelling
        if text not in ("True", "False"):
            raise ValueError(text)
        return text == "True"
    if tp in (int, float):
        return tp(text)
    return text  # str, Any


def _parse_many(texts: list[str], tp: Any) -> Any:
    """The arguments of a `_takes_many` key: `None` alone for a key that may be None, else a list."""
    args = get_args(tp) if _is_union(tp) else (tp,)
    if type(None) in args and texts == ["None"]:
        return None
    item = get_args(next(a for a in args if get_origin(a) is list))[0]
    return [_parse_one(t, item) for t in texts]


def _set(values: dict, path: tuple[str, ...], value: Any) -> None:
    for part in path[:-1]:
        values = values.setdefault(part, {})
    values[path[-1]] = value


def parse_overrides(argv: list[str], schema: type, toml: dict, refused: Refused = None) -> tuple[dict, list[str]]:
    """The `--section.key value` overrides of `argv` as nested dicts of typed values (the last one of a key
    wins), and one line per override that names no key or gives a value its key does not take (`refused`:
    the message for a name the schema lacks on purpose, None for an unknown one)."""
    values: dict = {}
    errors: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        key = _find_key(_option_name(arg), schema, toml, refused) if arg.startswith("--") and "." in arg else \
            "not an override; write --section.key value (-h lists the keys)"
        if isinstance(key, str):
            errors.append(f"{arg.split('=', 1)[0]}: {key}")
            if arg.startswith("--") and "=" not in arg and i < len(argv) and not argv[i].startswith("--"):
                i += 1  # its value: one line for the mistake
            continue
        shown = arg.split("=", 1)[0][2:]
        if key.tp in (bool, "no"):
            if "=" in arg:  # as tyro: a flag takes no value
                errors.append(f"{arg}: {key.where} is a flag: write --{'.'.join(key.path)} for true or "
                              f"--{'.'.join(key.path[:-1])}.no-{key.path[-1]} for false")
            else:
                _set(values, key.path, key.tp is bool)
            continue
        if "=" in arg:
            texts = [arg.split("=", 1)[1]]
        else:
            n = 0
            while i + n < len(argv) and not argv[i + n].startswith("--") and (n == 0 or _takes_many(key.tp)):
                n += 1
            texts, i = argv[i:i + n], i + n
            if not texts and not _takes_many(key.tp):
                errors.append(f"--{shown}: {key.where} needs a value ({type_words(key.tp)})")
                continue
        try:
            value = _parse_many(texts, key.tp) if _takes_many(key.tp) else _parse_one(texts[0], key.tp)
        except ValueError:
            errors.append(f"--{shown} {' '.join(texts)!r}: {key.where} must be {type_words(key.tp)}")
            continue
        _set(values, key.path, value)
    return values, errors


def is_flag(option: str, schema: type) -> bool:
    """Whether `--section.key` is a true/false key, which takes no value (`--parallelism.disable_loss_parallel`,
    `--parallelism.no-disable_loss_parallel`)."""
    key = _find_key(_option_name(option), schema, {})
    return isinstance(key, _Key) and key.tp in (bool, "no")


# ---- the instance: TOML values over the defaults, overrides over those, field by field ----

def _merged(toml: dict, overrides: dict) -> dict:
    out = dict(toml)
    for name, value in overrides.items():
        out[name] = _merged(out[name], value) if isinstance(value, dict) and isinstance(out.get(name), dict) \
            else value
    return out


def _build(cls: type, data: dict, where: str) -> Any:
    """`cls` from `data`; a section's own check (`__post_init__`) failing is a ConfigError naming it."""
    known = fields(cls)
    kwargs = {name: _build_value(known[name].type, value, f"{where}.{name}".lstrip(".")) for name, value in data.items()}
    try:
        return cls(**kwargs)
    except (ValueError, AssertionError) as err:
        raise ConfigError([f"[{where}] {err}"]) from None


def _build_value(tp: Any, value: Any, where: str) -> Any:
    if dataclasses.is_dataclass(tp) and isinstance(value, dict):
        return _build(tp, value, where)
    if (item := table_array_item(tp)) is not None and isinstance(value, list):
        return [_build(item, table, f"{where} #{i + 1}") for i, table in enumerate(value)]
    return value


def build_config(schema: type, toml: dict, overrides: dict) -> Any:
    """The schema's instance: its defaults, the TOML's values as written, then the overrides."""
    return _build(schema, _merged(toml, overrides), "")


def help_text(schema: type, usage: str) -> str:
    """`usage`, then every section and key of `schema` with its type and default, as `--section.key`."""
    lines = [usage, "", "Overrides: --section.key value (or =value); true/false keys: --section.key, "
             "--section.no-key; a list of strings: a,b,c; None for a key that may be None."]

    def section(cls: type, prefix: str) -> None:
        lines.extend(["", f"[{prefix}]"])
        nested = []
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(f.type):
                nested.append(f)
                continue
            default = field_default(f)
            shown = "" if default is None else f" (default: {toml_literal(default)})"
            words = "a flag" if f.type is bool else type_words(f.type)  # no value: --a.key, --a.no-key
            lines.append(f"  --{prefix}.{f.name}  {words}{shown}")
        for f in nested:
            section(f.type, f"{prefix}.{f.name}")

    for f in dataclasses.fields(schema):
        if dataclasses.is_dataclass(f.type):
            section(f.type, f.name)
        elif (item := table_array_item(f.type)) is not None:
            lines.extend(["", f"[[{f.name}]]  (TOML only: one table each)"])
            lines.extend(f"  {g.name}  {type_words(g.type)}" for g in dataclasses.fields(item))
        else:
            lines.extend(["", f"[{f.name}]", f"  --{f.name}.KEY  the keys its TOML table sets"])
    return "\n".join(lines)

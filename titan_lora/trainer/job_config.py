"""Parse `--job.config_file x.toml` plus CLI overrides into torchtitan's JobConfig with our sections.

torchtitan's parser and schema come through the seam (`titan_lora.titan.configs`)."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import logging
import os
import re
import tempfile
import tomllib
import types
from typing import Any, Literal, Union, get_args, get_origin

from titan_lora import config as ours
from titan_lora.lora.targets import resolve_targets
from titan_lora.models.family import FamilyLoRAConverter  # noqa: F401 (registers the "lora" converter)
from titan_lora.models.resolve import ResolvedModel, resolve_model
from titan_lora.titan.configs import merged_schema, parse_job_config
from titan_lora.titan.converters import registered_converters
from titan_lora.trainer.preflight import preflight

logger = logging.getLogger(__name__)
CUSTOM_CONFIG_MODULE = "titan_lora.config"
_OUR_SECTIONS = {"lora": ours.LoRA, "engine": ours.Engine, "weight_sync": ours.WeightSync, "data": ours.Data,
                 "grpo": ours.GRPO}
# Keys that left [weight_sync] when the engine got its own section: old configs get the new place.
_MOVED = {"engine_url": "[engine] url", "engine_port": "[engine] port", "api_key": "[engine] api_key",
          "engine_max_model_len": "[engine] max_model_len", "engine_kv_cache_gib": "[engine] kv_cache_gib",
          "pause_mode": "[engine] pause_mode", "disk_dir": "[engine] disk_dir",
          "emitter": '[engine] kind ("vllm", "vllm-disk" for emitter = "disk", "sglang")',
          "engine": '[engine] kind ("vllm" or "receiver")', "on_nonfinite": "[training] on_nonfinite"}


def _config_path(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg.startswith("--job.config_file"):
            return arg.split("=", 1)[1] if "=" in arg else argv[i + 1]
    return None


@functools.cache
def config_schema() -> type:
    """The merged JobConfig class (torchtitan's sections with titan_lora's merged in), as ConfigManager
    builds it: every section and key a TOML may name, with its type."""
    return merged_schema(ours.JobConfig)


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _did_you_mean(name: str, known: list[str], what: str) -> str:
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}?" if close else f"known {what}: {', '.join(sorted(known))}"


def type_fits(value: Any, tp: Any) -> bool:
    """Whether a TOML value suits a field annotated `tp` (an int suits a float; a bool suits no number)."""
    origin, args = get_origin(tp), get_args(tp)
    if origin in (Union, types.UnionType):
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
    if tp is dict or origin is dict or dataclasses.is_dataclass(tp):
        return isinstance(value, dict)
    return True  # a type TOML cannot spell (Any, None): left to the field's own checks


def type_words(tp: Any) -> str:
    """A field's type as a user reads it: "an integer", "a list of strings", "one of 'a', 'b'"."""
    origin, args = get_origin(tp), get_args(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(type_words(a) for a in args if a is not type(None))
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if tp is list or origin is list:
        return "a list" + (f" of {type_words(args[0]).split(' ', 1)[-1]}s" if args else "")
    words = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    return words.get(tp, "a table" if tp is dict or origin is dict or dataclasses.is_dataclass(tp) else str(tp))


def toml_literal(value: Any) -> str:
    """`value` as it is written in TOML."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_literal(v) for v in value) + "]"
    return repr(value)


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None


def _type_error(section: str, key: str, value: Any, f: dataclasses.Field) -> str:
    default = _default(f)
    example = f" (the default is {key} = {toml_literal(default)})" if default not in (None, "", []) else ""
    return f"[{section}] {key} = {toml_literal(value)} must be {type_words(f.type)}{example}"


def _section_errors(section: str, given: dict, cls: type) -> list[str]:
    known = _fields(cls)
    errors = []
    for key, value in given.items():
        if section == "weight_sync" and key in _MOVED:
            errors.append(f"[weight_sync] {key} has moved: use {_MOVED[key]}")
        elif section == "grpo" and key == "clip_eps":
            errors.append("[grpo] clip_eps was removed: with one update per batch the PPO ratio is 1 and the clip "
                          "never bound; stale samples are weighed by [grpo] stale_weight_cap. Delete the line")
        elif section == "grpo" and key == "async":
            errors.append(f'[grpo] async = {toml_literal(value)}: write loop = "async" (or "sync"); async is a '
                          "Python keyword, so the key is `loop`")
        elif key not in known:
            errors.append(f"[{section}] has an unknown key {key!r}; {_did_you_mean(key, list(known), 'keys')}")
        elif dataclasses.is_dataclass(known[key].type) and isinstance(value, dict):
            errors += _section_errors(f"{section}.{key}", value, known[key].type)
        elif not type_fits(value, known[key].type):
            errors.append(_type_error(section, key, value, known[key]))
        elif (out_of_range := ours.range_error(section, key, value)) is not None:
            errors.append(out_of_range)
    return errors


def toml_errors(toml: dict) -> list[str]:
    """One line per unknown section or key, per value of the wrong type, and per unknown converter."""
    sections = _fields(config_schema())
    errors = []
    for name, given in toml.items():
        if name not in sections:
            errors.append(f"[{name}] is not a config section; {_did_you_mean(name, list(sections), 'sections')}")
        elif not dataclasses.is_dataclass(sections[name].type):
            if not type_fits(given, sections[name].type):
                errors.append(f"[{name}] must be a table of options, got {toml_literal(given)}")
        elif not isinstance(given, dict):
            errors.append(f"{name} = {toml_literal(given)} must be a section: write [{name}] and its keys below it")
        else:
            errors += _section_errors(name, given, sections[name].type)
    converters, known = toml.get("model", {}).get("converters", []), registered_converters()
    for name in converters if isinstance(converters, list) else []:
        if name not in known:
            errors.append(f"[model] converters names {name!r}, which is not registered; "
                          f"known: {', '.join(known)}")
    return errors


def check_toml(toml: dict) -> None:
    """`toml_errors`, raised as one ConfigError."""
    errors = toml_errors(toml)
    if errors:
        raise ours.ConfigError(errors)


_NUMBER_PARSERS = {int: int, float: float}


def is_flag(option: str) -> bool:
    """Whether `--section.key` is a true/false key, which tyro takes without a value
    (`--parallelism.disable_loss_parallel`, `--parallelism.no-disable_loss_parallel`)."""
    section, _, key = option.lstrip("-").replace("-", "_").partition(".")
    cls = _fields(config_schema()).get(section)
    known = _fields(cls.type) if cls is not None and dataclasses.is_dataclass(cls.type) else {}
    key = key[3:] if key.startswith("no_") and key[3:] in known else key
    return key in known and known[key].type is bool


def override_errors(argv: list[str]) -> list[str]:
    """The `--section.key value` overrides that name no key, or give a number key a non-number (tyro would
    print a box and exit)."""
    sections = _fields(config_schema())
    errors = []
    for i, arg in enumerate(argv):
        if not arg.startswith("--") or "." not in arg:
            continue
        name, eq, value = arg[2:].partition("=")
        section, _, key = name.replace("-", "_").partition(".")
        if section in sections and not dataclasses.is_dataclass(sections[section].type):
            continue  # a free-form table ([task]): what it holds is its plug-in's to check
        if section not in sections:
            errors.append(f"{arg.split('=')[0]}: [{section}] is not a config section; "
                          f"{_did_you_mean(section, list(sections), 'sections')}")
            continue
        known = _fields(sections[section].type)
        if key.startswith("no_") and key[3:] in known and known[key[3:]].type is bool:
            continue  # tyro's negated flag: --parallelism.no-disable_loss_parallel
        if key not in known:
            errors.append(f"--{name}: [{section}] has an unknown key {key!r}; "
                          f"{_did_you_mean(key, list(known), 'keys')}")
            continue
        tp = known[key].type
        parse = _NUMBER_PARSERS.get(next((a for a in get_args(tp) if a in _NUMBER_PARSERS), tp))
        if not eq:
            value = argv[i + 1] if i + 1 < len(argv) else ""
        if parse is not None and value != "None":
            try:
                parse(value)
            except ValueError:
                errors.append(f"--{name} {value!r}: [{section}] {key} must be {type_words(tp)}")
    return errors


_TOML_POSITION = re.compile(r"^(?P<msg>.*) \(at line (?P<line>\d+), column (?P<col>\d+)\)$")


def read_toml(path: str) -> dict:
    """The TOML file at `path`; a missing file or a syntax error is a ConfigError naming file, line and column."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ours.ConfigError([f"--job.config_file {path!r}: no such file"]) from None
    except tomllib.TOMLDecodeError as err:
        m = _TOML_POSITION.match(str(err))
        where = f"{path}:{m['line']}:{m['col']}" if m else path
        raise ours.ConfigError([f"{where}: TOML syntax error: {m['msg'] if m else err}"]) from None


def check_targets(job_config, model: ResolvedModel | None = None) -> list[str] | None:  # noqa: ANN001
    """Resolve `[lora] target_modules` on a meta-device copy of the model (milliseconds, no memory).

    Returns the qualified names of the linears to adapt; None without the "lora" converter.
    """
    if "lora" not in job_config.model.converters:
        return None
    model = model or resolve_model(job_config.model)
    return resolve_targets(model.meta_model(), job_config.lora.target_modules, model.family.leaf_names)


def _names_key(toml: dict, argv: list[str], section: str, key: str) -> bool:
    """Whether the TOML or an override sets `[section] key`."""
    flag = f"{section}.{key}"  # tyro takes --a_b.c_d and --a-b.c-d alike
    return key in toml.get(section, {}) or any(
        a.startswith("--") and a[2:].split("=", 1)[0].replace("-", "_") == flag for a in argv)


def derive_keep_versions(job_config, named: bool) -> None:  # noqa: ANN001
    """Raise `[weight_sync] keep_versions` to what `[grpo]` needs when the config left it out (`named`
    False); a value the user wrote is checked by `validate_grpo` instead."""
    ws, need = job_config.weight_sync, ours.versions_needed(job_config.grpo)
    if not named and ws.keep_versions < need:
        logger.info("[weight_sync] keep_versions = %d (derived: [grpo] max_staleness = %d, loop = %s)", need,
                    job_config.grpo.max_staleness, job_config.grpo.loop)
        ws.keep_versions = need


def load_job(argv: list[str]) -> tuple[Any, ResolvedModel]:
    """The merged JobConfig and its `[model]` resolved (family, shape, vocab, weights checked) once, for
    `build_model`; raises ValueError on a bad config before anything is built."""
    path = _config_path(argv)
    toml = read_toml(path) if path is not None else {}
    errors = toml_errors(toml) if path is not None else []
    errors += override_errors(argv)
    if errors:  # before tyro: it would keep a wrong-typed TOML value and box a wrong CLI one
        raise ours.ConfigError(errors)
    job_config = parse_job_config(argv, CUSTOM_CONFIG_MODULE)
    errors = ours.all_range_errors(job_config)
    if errors:  # every out-of-range value at once, before any check that builds on them
        raise ours.ConfigError(errors)
    if job_config.lora.export_dir:  # relative: under the run's folder, as [checkpoint] folder is
        job_config.lora.export_dir = os.path.join(job_config.job.dump_folder, job_config.lora.export_dir)
    ours.validate_lora(job_config.lora)
    model = resolve_model(job_config.model)
    targets = check_targets(job_config, model)
    ours.validate_training(job_config.training)
    ours.validate_engine(job_config.engine)
    ours.validate_weight_sync(job_config.weight_sync)
    derive_keep_versions(job_config, _names_key(toml, argv, "weight_sync", "keep_versions"))
    ours.validate_grpo(job_config.grpo, job_config.weight_sync)
    preflight(job_config, targets)
    return job_config, model


def load_job_config(argv: list[str]):  # noqa: ANN201 (a dataclass type made at run time)
    """The merged JobConfig (`load_job` without the resolved model)."""
    return load_job(argv)[0]


def job_from_toml(toml: str, *overrides: str) -> tuple[Any, ResolvedModel]:
    """`load_job` on TOML text plus CLI-style overrides (notebooks, tests, benchmarks)."""
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(toml)
    try:
        return load_job(["--job.config_file", f.name, *overrides])
    finally:
        os.unlink(f.name)


def job_config_from_toml(toml: str, *overrides: str):  # noqa: ANN201
    """Parse TOML text (plus CLI-style overrides) into the merged JobConfig (notebooks, tests, benchmarks)."""
    return job_from_toml(toml, *overrides)[0]

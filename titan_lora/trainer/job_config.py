"""Load a job: `--job.config_file x.toml` plus CLI overrides, checked key by key, parsed by titan_lora's own
parser (`toml_config`) into titan_lora's schema (`config.JobConfig`: the run's sections with torchtitan 0.2.2's
names, and titan_lora's own), then validated across sections before anything is built."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import tempfile
from typing import Any

from titan_lora import config as ours
from titan_lora.config import JobConfig
from titan_lora.config_adapters import FALLBACK, adapter_errors, job_adapters, section_key
from titan_lora.config_ranges import all_range_errors, range_error
from titan_lora.lora.targets import resolve_targets
from titan_lora.models.family import FamilyLoRAConverter  # noqa: F401 (registers the "lora" converter)
from titan_lora.models.resolve import ResolvedModel, resolve_model
from titan_lora.run_sections import (
    DROPPED_KEYS,
    DROPPED_SECTIONS,
    validate_activation_checkpoint,
    validate_compile,
)
from titan_lora.titan.configs import quiet_torchtitan_asset_warnings
from titan_lora.titan.converters import registered_converters
from titan_lora.trainer.preflight import preflight
from titan_lora.trainer.toml_config import (
    HELP_FLAGS,
    build_config,
    config_path,
    did_you_mean,
    field_default,
    fields,
    help_text,
    is_flag as schema_is_flag,
    parse_overrides,
    read_toml,
    table_array_item,
    toml_literal,
    type_fits,
    type_words,
)

logger = logging.getLogger(__name__)
# Keys that left [weight_sync] when the engine got its own section: old configs get the new place.
_MOVED = {"engine_url": "[engine] url", "engine_port": "[engine] port", "api_key": "[engine] api_key",
          "engine_max_model_len": "[engine] max_model_len", "engine_kv_cache_gib": "[engine] kv_cache_gib",
          "pause_mode": "[engine] pause_mode", "disk_dir": "[engine] disk_dir",
          "emitter": '[engine] kind ("vllm", "vllm-disk" for emitter = "disk", "sglang")',
          "engine": '[engine] kind ("vllm" or "receiver")', "on_nonfinite": "[training] on_nonfinite"}


def config_schema() -> type:
    """The JobConfig class: every section and key a TOML may name, with its type."""
    return ours.JobConfig


def refused(path: tuple[str, ...]) -> str | None:
    """Why a section (`(name,)`) or key (`(section, key)`) of torchtitan 0.2.2 that titan_lora's schema left
    out is refused, with the fix; None for any other name."""
    if len(path) == 1 and path[0] in DROPPED_SECTIONS:
        return (f"[{path[0]}] is torchtitan 0.2.2's section, which titan_lora does not take: "
                f"{DROPPED_SECTIONS[path[0]]}; delete the section")
    if len(path) == 2 and path in DROPPED_KEYS:
        return (f"[{path[0]}] {path[1]} is torchtitan 0.2.2's key, which titan_lora does not take: "
                f"{DROPPED_KEYS[path]}; delete the line")
    return None


def _type_error(section: str, key: str, value: Any, f: dataclasses.Field) -> str:
    default = field_default(f)
    example = f" (the default is {key} = {toml_literal(default)})" if default not in (None, "", []) else ""
    return f"[{section}] {key} = {toml_literal(value)} must be {type_words(f.type)}{example}"


def _section_errors(section: str, given: dict, cls: type) -> list[str]:
    known = fields(cls)
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
        elif (why := refused((section, key))) is not None:
            errors.append(why)
        elif key not in known:
            errors.append(f"[{section}] has an unknown key {key!r}; {did_you_mean(key, list(known), 'keys')}")
        elif dataclasses.is_dataclass(known[key].type) and isinstance(value, dict):
            errors += _section_errors(f"{section}.{key}", value, known[key].type)
        elif not type_fits(value, known[key].type):
            errors.append(_type_error(section, key, value, known[key]))
        elif (out_of_range := range_error(section, key, value)) is not None:
            errors.append(out_of_range)
    return errors


def toml_errors(toml: dict) -> list[str]:
    """One line per unknown section or key, per value of the wrong type, and per unknown converter."""
    sections = fields(config_schema())
    errors = []
    for name, given in toml.items():
        if (why := refused((name,))) is not None:
            errors.append(why)
        elif name not in sections:
            errors.append(f"[{name}] is not a config section; {did_you_mean(name, list(sections), 'sections')}")
        elif (item := table_array_item(sections[name].type)) is not None:
            if not isinstance(given, list) or not all(isinstance(table, dict) for table in given):
                errors.append(f"{name} must be an array of tables: write [[{name}]] above each one's keys")
            else:
                errors += [e for i, table in enumerate(given) for e in _section_errors(f"{name} #{i + 1}", table, item)]
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


def is_flag(option: str) -> bool:
    """Whether `--section.key` is a true/false key, which takes no value (`--parallelism.disable_loss_parallel`,
    `--parallelism.no-disable_loss_parallel`)."""
    return schema_is_flag(option, config_schema())


def check_targets(job_config: JobConfig, model: ResolvedModel | None = None) -> list[str] | None:
    """Resolve `[lora] target_modules` (each adapter's, with several `[[adapters]]`) on a meta-device copy of
    the model (milliseconds, no memory).

    Returns the qualified names of the linears to adapt (any adapter's); None without the "lora" converter.
    """
    return union_of(adapter_targets(job_config, model))


def union_of(found: list[list[str]] | None) -> list[str] | None:
    """One adapter's targets as they are; several adapters': every linear any of them adapts, sorted."""
    if found is None or len(found) == 1:
        return None if found is None else found[0]
    return sorted({t for targets in found for t in targets})


def adapter_targets(job_config: JobConfig, model: ResolvedModel | None = None) -> list[list[str]] | None:
    """Each adapter's linears to adapt, in table order (one list for a one-adapter job); None without the
    "lora" converter. A target no linear has is refused naming its table."""
    if "lora" not in job_config.model.converters:
        return None
    model = model or resolve_model(job_config.model)
    meta = model.meta_model()
    if len(job_config.adapters) <= 1:
        return [resolve_targets(meta, job_config.lora.target_modules, model.family.leaf_names)]
    found = []
    for adapter in job_adapters(job_config):
        try:
            found.append(resolve_targets(meta, adapter.target_modules, model.family.leaf_names))
        except ValueError as err:
            raise ValueError(f"[[adapters]] {adapter.name!r}: {str(err).removeprefix('[lora] ')}") from None
    return found


def apply_adapter_tables(job_config: JobConfig) -> None:
    """One `[[adapters]]` table: its keys set over the sections' and its name as `[weight_sync] lora_name`, so
    the job is the one-adapter job those sections describe. Several tables are resolved where each part uses
    them (`config_adapters.job_adapters`); agent tasks are refused where tasks are built
    (`compose.check_plugins`)."""
    tables = job_config.adapters
    if len(tables) != 1:
        return
    (adapter,) = job_adapters(job_config)
    for key, section in FALLBACK.items():
        setattr(getattr(job_config, section), section_key(key), getattr(adapter, key))
    job_config.weight_sync.lora_name = adapter.name


def derive_keep_versions(job_config: JobConfig, named: bool) -> None:
    """Raise `[weight_sync] keep_versions` to what `[grpo]` needs when the config left it out (`named`
    False); a value the user wrote is checked by `validate_grpo` instead."""
    ws, need = job_config.weight_sync, ours.versions_needed(job_config.grpo)
    if not named and ws.keep_versions < need:
        logger.info("[weight_sync] keep_versions = %d (derived: [grpo] max_staleness = %d, loop = %s)", need,
                    job_config.grpo.max_staleness, job_config.grpo.loop)
        ws.keep_versions = need


USAGE = ("usage: torchrun --nproc_per_node=N -m titan_lora.train --job.config_file CONFIG.toml "
         "[--section.key value ...]\n(or: titan-lora check|train CONFIG.toml ...; every key with what it does: "
         "docs/config.md)")


def parse_job(argv: list[str]) -> tuple[Any, dict, dict]:
    """`argv` parsed: the config (schema defaults, the TOML, then the overrides), the TOML and the
    overrides as read; every unknown key and bad value raised at once as a ConfigError, before any is used.
    `-h`/`--help` prints every key and exits."""
    if any(arg in HELP_FLAGS for arg in argv):
        print(help_text(config_schema(), USAGE))
        sys.exit(0)
    path = config_path(argv)
    toml = read_toml(path) if path is not None else {}
    errors = toml_errors(toml)
    overrides, bad = parse_overrides(argv, config_schema(), toml, refused)
    if errors + bad:  # every mistake at once, before a value is used
        raise ours.ConfigError(errors + bad)
    job_config = build_config(config_schema(), toml, overrides)
    return job_config, toml, overrides


def load_job(argv: list[str]) -> tuple[Any, ResolvedModel]:
    """The JobConfig and its `[model]` resolved (family, shape, vocab, weights checked) once, for
    `build_model`; raises ValueError on a bad config before anything is built."""
    quiet_torchtitan_asset_warnings()  # torchtitan warns while building
    job_config, toml, overrides = parse_job(argv)
    errors = all_range_errors(job_config) + adapter_errors(job_config.adapters)
    if errors:  # every out-of-range value at once, before any check that builds on them
        raise ours.ConfigError(errors)
    apply_adapter_tables(job_config)
    if job_config.lora.export_dir:  # relative: under the run's folder, as [checkpoint] folder is
        job_config.lora.export_dir = os.path.join(job_config.job.dump_folder, job_config.lora.export_dir)
    ours.validate_lora(job_config.lora)
    model = resolve_model(job_config.model)
    per_adapter = adapter_targets(job_config, model)
    targets = union_of(per_adapter)
    ours.validate_training(job_config.training)
    validate_activation_checkpoint(job_config.activation_checkpoint)
    validate_compile(job_config.compile)
    ours.validate_engine(job_config.engine)
    ours.validate_weight_sync(job_config.weight_sync)
    named = "keep_versions" in {**toml.get("weight_sync", {}), **overrides.get("weight_sync", {})}
    derive_keep_versions(job_config, named)
    ours.validate_grpo(job_config.grpo, job_config.weight_sync)
    preflight(job_config, targets, model.shape, per_adapter if len(job_config.adapters) > 1 else None)
    return job_config, model


def load_job_config(argv: list[str]):  # noqa: ANN201 (a dataclass type made at run time)
    """The JobConfig (`load_job` without the resolved model)."""
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
    """Parse TOML text (plus CLI-style overrides) into the JobConfig (notebooks, tests, benchmarks)."""
    return job_from_toml(toml, *overrides)[0]

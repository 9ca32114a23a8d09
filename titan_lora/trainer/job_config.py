"""Parse `--job.config_file x.toml` plus CLI overrides into torchtitan's JobConfig with our sections."""

from __future__ import annotations

import dataclasses
import difflib
import os
import tempfile
import tomllib
from typing import Any

from torchtitan.config import ConfigManager
from torchtitan.protocols.model_converter import _registry_model_converter_cls

from titan_lora import config as ours
from titan_lora.lora.targets import resolve_targets
from titan_lora.models.family import FamilyLoRAConverter  # noqa: F401 (registers the "lora" converter)
from titan_lora.models.resolve import ResolvedModel, quiet_torchtitan_asset_warnings, resolve_model
from titan_lora.trainer.preflight import preflight

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


def _check_keys(section: str, given: dict, cls: type) -> None:
    known = {f.name for f in dataclasses.fields(cls)}
    for key in given:
        if section == "weight_sync" and key in _MOVED:
            raise ValueError(f"[weight_sync] {key} has moved: use {_MOVED[key]}")
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(sorted(known))}"
            raise ValueError(f"[{section}] has an unknown key {key!r}; {hint}")


def check_toml(toml: dict) -> None:
    """Reject unknown keys in our sections and unknown converters, naming the key and the fix."""
    for section, cls in _OUR_SECTIONS.items():
        _check_keys(section, toml.get(section, {}), cls)
    for name in toml.get("model", {}).get("converters", []):
        if name not in _registry_model_converter_cls:
            known = ", ".join(sorted(_registry_model_converter_cls))
            raise ValueError(f"[model] converters names {name!r}, which is not registered; known: {known}")


def check_targets(job_config, model: ResolvedModel | None = None) -> list[str] | None:  # noqa: ANN001
    """Resolve `[lora] target_modules` on a meta-device copy of the model (milliseconds, no memory).

    Returns the qualified names of the linears to adapt; None without the "lora" converter.
    """
    if "lora" not in job_config.model.converters:
        return None
    model = model or resolve_model(job_config.model)
    return resolve_targets(model.meta_model(), job_config.lora.target_modules, model.family.leaf_names)


def load_job(argv: list[str]) -> tuple[Any, ResolvedModel]:
    """The merged JobConfig and its `[model]` resolved (family, shape, vocab, weights checked) once, for
    `build_model`; raises ValueError on a bad config before anything is built."""
    path = _config_path(argv)
    if path is not None:
        with open(path, "rb") as f:
            check_toml(tomllib.load(f))
    args = [*argv, f"--job.custom_config_module={CUSTOM_CONFIG_MODULE}"]
    quiet_torchtitan_asset_warnings()  # torchtitan warns while parsing and building
    job_config = ConfigManager().parse_args(args)
    if job_config.lora.export_dir:  # relative: under the run's folder, as [checkpoint] folder is
        job_config.lora.export_dir = os.path.join(job_config.job.dump_folder, job_config.lora.export_dir)
    ours.validate_lora(job_config.lora)
    model = resolve_model(job_config.model)
    targets = check_targets(job_config, model)
    ours.validate_training(job_config.training)
    ours.validate_engine(job_config.engine)
    ours.validate_weight_sync(job_config.weight_sync)
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

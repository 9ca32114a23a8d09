"""The rules generated from the config dataclasses: every key's type and every range in `RANGES`, refused by
name in one line before torchtitan or the model sees the value; unknown sections; TOML syntax errors."""

from __future__ import annotations

import dataclasses
import math

import pytest
from model_helpers import DEBUG_LORA, job_config_from

from titan_lora.config import WeightSync, validate_weight_sync
from titan_lora.config_ranges import RANGES, ConfigError, all_range_errors
from titan_lora.trainer.job_config import config_schema, toml_errors
from titan_lora.trainer.toml_config import parse_overrides, read_toml, toml_literal, type_fits


def _keys() -> list[tuple[str, str, object]]:
    keys = []
    for section in dataclasses.fields(config_schema()):
        if dataclasses.is_dataclass(section.type):
            keys += [(section.name, f.name, f.type) for f in dataclasses.fields(section.type)
                     if not dataclasses.is_dataclass(f.type)]
    return keys


KEYS = _keys()


@pytest.mark.parametrize(("section", "key", "tp"), KEYS, ids=[f"{s}.{k}" for s, k, _ in KEYS])
def test_a_value_of_the_wrong_type_is_refused_by_name(section: str, key: str, tp: object) -> None:
    wrong = next(v for v in ("x", 3.5, [3.5], {"a": 1}) if not type_fits(v, tp))
    errors = toml_errors({section: {key: wrong}})
    assert len(errors) == 1 and errors[0].startswith(f"[{section}] {key} = {toml_literal(wrong)} must be "), errors


def _outside(rule) -> float:
    if rule.lo is not None:
        return rule.lo if rule.lo_open else rule.lo - 1
    return rule.hi + 1


def _typed(section: str, key: str, value: float) -> float:
    tp = dict(((s, k), t) for s, k, t in KEYS)[(section, key)]
    return int(value) if type_fits(1, tp) and not type_fits(0.5, tp) else float(value)


@pytest.mark.parametrize(("section", "key"), list(RANGES), ids=[f"{s}.{k}" for s, k in RANGES])
def test_a_value_out_of_range_is_refused_by_name_in_the_toml(section: str, key: str) -> None:
    value = _typed(section, key, _outside(RANGES[section, key]))
    errors = toml_errors({section: {key: value}})
    assert errors == [f"[{section}] {key} must be {RANGES[section, key].describe()}, got {value}"
                      + (f"; {RANGES[section, key].fix}" if RANGES[section, key].fix else "")]


def test_every_range_is_checked_on_the_parsed_config_too() -> None:
    """CLI overrides reach the parsed config without passing the TOML check: each rule holds there too."""
    cfg = job_config_from(DEBUG_LORA)
    assert all_range_errors(cfg) == []
    for section, key in RANGES:
        setattr(getattr(cfg, section), key, _typed(section, key, _outside(RANGES[section, key])))
    errors = all_range_errors(cfg)
    assert sorted(e.split(" must be ")[0] for e in errors) == sorted(f"[{s}] {k}" for s, k in RANGES)
    with pytest.raises(ConfigError, match=r"^\[training\] steps must be >= 1, got 0"):
        job_config_from(DEBUG_LORA, "--training.steps", "0")


FLOAT_KEYS = [(s, k) for s, k, tp in KEYS if type_fits(0.5, tp)]


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_every_float_key_refuses_a_value_that_is_not_finite(value: float) -> None:
    """NaN passes every comparison, so a lower bound alone let it through (timeouts, lr, kl_coef, ...)."""
    assert len(FLOAT_KEYS) >= 16 and ("weight_sync", "health_timeout_s") in FLOAT_KEYS
    for section, key in FLOAT_KEYS:
        errors = toml_errors({section: {key: value}})
        assert len(errors) == 1 and errors[0].startswith(f"[{section}] {key} must be a finite number"), errors
        assert errors[0].split(", got ")[1].startswith(str(value)), errors
    cfg = job_config_from(DEBUG_LORA)  # an override reaches the parsed config: refused there too
    for section, key in FLOAT_KEYS:
        setattr(getattr(cfg, section), key, value)
    cfg.task = {"scale": value, "weights": [1.0, value], "name": "x"}
    errors = all_range_errors(cfg)
    assert sorted(e.split(" must be ")[0] for e in errors) == sorted(
        [f"[{s}] {k}" for s, k in FLOAT_KEYS] + ["[task] scale", "[task] weights"])
    with pytest.raises(ConfigError, match=r"^\[optimizer\] lr must be a finite number > 0, got nan; try lr = 2e-4"):
        job_config_from(DEBUG_LORA, "--optimizer.lr", "nan")


def test_a_timeout_is_at_most_a_day_and_their_sum_fits_the_process_group_timeout() -> None:
    assert toml_errors({"weight_sync": {"health_timeout_s": 86400.5}}) == [
        "[weight_sync] health_timeout_s must be > 0 and <= 86400 seconds (a day), got 86400.5"]
    assert toml_errors({"weight_sync": {"rollout_timeout_s": 86400}}) == []
    validate_weight_sync(WeightSync(enabled=True, rollout_timeout_s=86400.0))  # 4 tries + restarts: about 4 days
    with pytest.raises(ValueError) as err:  # each in range, but rank 0 could wait past any timeout torch holds
        validate_weight_sync(WeightSync(enabled=True, retries=10**6))
    # 4 tries of (10**6 + 1) transfers of 130 s, + 30 s retire, and 3 restarts of 610 s
    assert str(err.value).startswith("[weight_sync] timeouts, retries and engine_restarts let rank 0 wait "
                                     "520002470 s between collectives")
    assert str(err.value).endswith("past the process-group timeout's limit of 604800 s (a week); lower the "
                                   "*_timeout_s keys, retries or engine_restarts")
    validate_weight_sync(WeightSync(enabled=False, retries=10**6))  # no engine: the default timeout holds


def test_unknown_sections_and_keys_name_the_one_meant() -> None:
    assert toml_errors({"weightsync": {}, "optimiser": {}, "zzz": {}})[:2] == [
        "[weightsync] is not a config section; did you mean 'weight_sync'?",
        "[optimiser] is not a config section; did you mean 'optimizer'?",
    ]
    assert toml_errors({"zzz": {}})[0].startswith("[zzz] is not a config section; known sections: ")
    assert toml_errors({"training": {"stpes": 3}}) == ["[training] has an unknown key 'stpes'; did you mean 'steps'?"]
    assert toml_errors({"lora": 3}) == ["lora = 3 must be a section: write [lora] and its keys below it"]
    assert toml_errors({"checkpoint": {"intervall": 5}}) == [
        "[checkpoint] has an unknown key 'intervall'; did you mean 'interval'?"]


def override_errors(argv: list[str], toml: dict | None = None) -> list[str]:
    return parse_overrides(argv, config_schema(), toml or {})[1]


def test_overrides_are_checked_by_name() -> None:
    assert override_errors(["--job.config_file", "x.toml", "--lora.rank", "8", "--parallelism.disable_loss_parallel",
                            "--parallelism.no-disable_loss_parallel", "--optimizer.lr=1e-4"]) == []
    assert override_errors(["--lora.rank", "sixteen", "--optimizer.lr=fast", "--lr_sched.warmup_steps", "2"]) == [
        "--lora.rank 'sixteen': [lora] rank must be an integer",
        "--optimizer.lr 'fast': [optimizer] lr must be a number",
        "--lr_sched.warmup_steps: [lr_sched] is not a config section; did you mean 'lr_scheduler'?",
    ]


def test_a_toml_syntax_error_names_file_line_and_column(tmp_path) -> None:
    bad = tmp_path / "job.toml"
    bad.write_text("[lora]\nrank = 8\nalpha =\n")
    with pytest.raises(ConfigError) as err:
        read_toml(str(bad))
    assert err.value.errors == [f"{bad}:3:8: TOML syntax error: Invalid value"]
    with pytest.raises(ConfigError, match=r"--job.config_file '.*missing.toml': no such file"):
        read_toml(str(tmp_path / "missing.toml"))
    with pytest.raises(ConfigError) as err:  # a directory was an IsADirectoryError traceback
        read_toml(str(tmp_path))
    assert err.value.errors == [f"--job.config_file {str(tmp_path)!r} cannot be read (Is a directory); "
                                "name a TOML file"]


def test_an_override_of_a_free_form_table_is_left_to_its_plug_in() -> None:
    toml = {"task": {"path": "a.jsonl", "answer_key": "b"}}
    assert override_errors(["--task.path", "data/x.jsonl", "--task.answer_key", "a"], toml) == []
    assert override_errors(["--tsak.path", "x"]) and "did you mean 'task'" in override_errors(["--tsak.path", "x"])[0]

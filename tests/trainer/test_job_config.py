"""The rules generated from the config dataclasses: every key's type and every range in `RANGES`, refused by
name in one line before torchtitan or the model sees the value; unknown sections; TOML syntax errors."""

from __future__ import annotations

import dataclasses

import pytest
from model_helpers import DEBUG_LORA, job_config_from

from titan_lora.config import RANGES, ConfigError, all_range_errors
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


def _outside(rule) -> float:  # noqa: ANN001
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
    assert [e.split(" must be ")[0] for e in errors] == [f"[{s}] {k}" for s, k in RANGES]
    with pytest.raises(ConfigError, match=r"^\[training\] steps must be >= 1, got 0"):
        job_config_from(DEBUG_LORA, "--training.steps", "0")


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


def test_an_override_of_a_free_form_table_is_left_to_its_plug_in() -> None:
    toml = {"task": {"path": "a.jsonl", "answer_key": "b"}}
    assert override_errors(["--task.path", "data/x.jsonl", "--task.answer_key", "a"], toml) == []
    assert override_errors(["--tsak.path", "x"]) and "did you mean 'task'" in override_errors(["--tsak.path", "x"])[0]

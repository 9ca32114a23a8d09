"""titan_lora's own config parse (TOML plus `--section.key value` overrides, no tyro) into its own schema: every
key it kept has the value torchtitan 0.2.2's ConfigManager gave (recorded in toml_0_2_2.json), and the overrides
it refused are refused by name."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest

from titan_lora.config import ConfigError
from titan_lora.trainer.job_config import config_schema, is_flag, parse_job
from titan_lora.trainer.toml_config import build_config, help_text, parse_overrides

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted(str(p.relative_to(REPO)) for p in (REPO / "train_configs").rglob("*.toml"))
OVERRIDES = {
    "none": [],
    "int, float, str, spelled with = and with -": ["--training.steps", "3", "--optimizer.lr=1e-4",
                                                   "--job.description", "x y", "--weight-sync.keep-versions=4"],
    "flags": ["--parallelism.disable_loss_parallel", "--lora.no_replicate_adapters", "--checkpoint.no-enable",
              "--compile.enable"],
    "lists": ["--model.converters", "lora", "--compile.components=model", "--lora.target_modules", "wq,wv"],
    "None, Literal, float | int": [
        "--debug.seed", "None", "--lr_scheduler.total_steps", "None", "--lr_scheduler.decay_ratio", "0.5",
        "--training.mixed_precision_param", "bfloat16", "--training.max_norm", "2"],
    "the last of a key wins": ["--training.steps", "3", "--training.steps=5", "--lora.export_dir="],
}
TASK_TOML = """
[grpo]
task = "jsonl"
[task]
path = "a.jsonl"
n = 2
f = 0.5
on = true
words = ["a", "b"]
ints = [1, 2]
mixed = [1, 2.5]
empty = []
[task.sub]
k = 1
"""
TASK_OVERRIDES = ["--task.path", "b.jsonl", "--task.n=-5", "--task.f", "3", "--task.no-on", "--task.words", "c,d",
                  "e", "--task.ints", "3", "4", "--task.mixed", "3", "4.5", "--task.empty", "--task.sub.k", "7"]


def _typed(value: object) -> object:
    """`value` with the type of every leaf: 32 and 32.0 differ."""
    if isinstance(value, dict):
        return {k: _typed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_typed(v) for v in value]
    return type(value).__name__, value


RECORD = json.loads(Path(__file__).with_name("toml_0_2_2.json").read_text())
"""What torchtitan 0.2.2's ConfigManager (TOML + tyro) parsed, cut to the keys titan_lora kept, as `section.key:
[type, value]` (32 and 32.0 differ): `configs` for every shipped config x OVERRIDES set (each set as its
difference from "none"), `task` for TASK_TOML without and with TASK_OVERRIDES. Recorded with torchtitan 0.2.2
installed (by the live comparison this test made up to main ac88096), at the switch to 0.3.0 (which has
no TOML), with the two defaults titan_lora changed on purpose
(`[model] hf_assets_path = ""`, `[compile] components = ["model"]`) applied."""
CHANGED_AT_030 = {"parallelism.disable_loss_parallel": ["bool", True]}
"""Keys whose value changed at the switch to 0.3.0: loss parallelism is not offered (the head's logits are always
gathered), so the key is always true."""
ADDED_SINCE = {"engine.cpu_threads": ["int", 0], "engine.standby": ["str", "auto"], "adapters": [],
               "service.host": ["str", "127.0.0.1"], "service.port": ["int", 8000], "service.base_model": ["str", ""],
               "service.api_keys": [], "service.max_adapters": ["int", 4], "service.max_adapters_per_key": ["int", 0],
               "service.max_rank": ["int", 32],
               "service.lora_alpha": ["float", 32.0], "service.state_dir": ["str", "service_states"],
               "service.max_request_tokens": ["int", 65536],
               "service.micro_batch_tokens": ["int", 1024], "service.max_queued": ["int", 256],
               "service.session_timeout_s": ["float", 120.0], "grpo.adapter_batches": ["str", "auto"]}
"""Keys titan_lora added after the record, at their defaults (no shipped config sets them); each new key is named
here, so that a key that appears or vanishes unannounced still fails."""


def _typed_flat(value: object, prefix: str = "") -> dict:
    """`value` flattened to `section.key` -> [type name, value], as RECORD holds it."""
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _typed_flat(item, f"{prefix}{key}.").items()}
    def typed(leaf: object) -> object:
        return [typed(v) for v in leaf] if isinstance(leaf, list) else [type(leaf).__name__, leaf]
    return {prefix.removesuffix("."): json.loads(json.dumps(typed(value)))}


def _ours(argv: list[str]) -> dict:
    return _typed_flat(dataclasses.asdict(parse_job(argv)[0]))


@pytest.mark.parametrize("overrides", list(OVERRIDES))
@pytest.mark.parametrize("config", sorted(RECORD["configs"]))
def test_every_shipped_config_parses_as_torchtitan_0_2_2_parsed_it(config: str, overrides: str, monkeypatch) -> None:
    """The no-behaviour-change guarantee of titan_lora's own parser and schema: every section and key it kept
    has the value and type torchtitan 0.2.2's ConfigManager (TOML + tyro) gave (but the defaults changed on
    purpose, and CHANGED_AT_030)."""
    monkeypatch.chdir(REPO)
    logging.getLogger().setLevel(logging.ERROR)  # torchtitan's asset warnings
    recorded = RECORD["configs"][config]
    assert _ours(["--job.config_file", config, *OVERRIDES[overrides]]) == {
        **recorded["none"], **recorded[overrides], **CHANGED_AT_030, **ADDED_SINCE}


def test_the_record_covers_the_configs_shipped_before_the_switch() -> None:
    assert set(RECORD["configs"]) <= set(SHIPPED), set(RECORD["configs"]) - set(SHIPPED)
    assert all(set(sets) == set(OVERRIDES) for sets in RECORD["configs"].values())


def test_a_free_form_table_is_overridden_as_torchtitan_0_2_2_did(tmp_path) -> None:
    """[task]: only the keys its TOML sets, each typed by its TOML value."""
    config = tmp_path / "task.toml"
    config.write_text(TASK_TOML)
    for name, overrides in (("none", []), ("overrides", TASK_OVERRIDES)):
        ours = _ours(["--job.config_file", str(config), *overrides])
        assert ours == {**RECORD["task"][name], "job.config_file": ["str", str(config)], **CHANGED_AT_030,
                        **ADDED_SINCE}
    task = parse_job(["--job.config_file", str(config), *TASK_OVERRIDES])[0].task
    assert task == {"path": "b.jsonl", "n": -5, "f": 3.0, "on": False, "words": ["c,d", "e"], "ints": [3, 4],
                    "mixed": [3, 4.5], "empty": [], "sub": {"k": 7}}


def _errors(*argv: str, toml: dict | None = None) -> list[str]:
    return parse_overrides(list(argv), config_schema(), toml or {})[1]


def test_what_tyro_refused_with_a_box_is_one_line_naming_the_key() -> None:
    assert _errors("--training.mixed_precision_param", "bf16", "--debug.seed", "none", "--training.steps", "3.0",
                   "--model.converters") == [
        "--training.mixed_precision_param 'bf16': [training] mixed_precision_param must be one of 'bfloat16', "
        "'float32'",
        "--debug.seed 'none': [debug] seed must be an integer",
        "--training.steps '3.0': [training] steps must be an integer",
        "--model.converters: [model] converters needs a value (a list of strings)",
    ]
    assert _errors("--parallelism.disable_loss_parallel=true", "--lora.no-rank") == [
        "--parallelism.disable_loss_parallel=true: [parallelism] disable_loss_parallel is a flag: write "
        "--parallelism.disable_loss_parallel for true or --parallelism.no-disable_loss_parallel for false",
        "--lora.no-rank: [lora] has an unknown key 'no_rank'; did you mean 'rank'?",
    ]
    assert _errors("--lora.target_modules", "wq", "wv", "--help-me", "--lora", "8") == [
        "wv: not an override; write --section.key value (-h lists the keys)",
        "--help-me: not an override; write --section.key value (-h lists the keys)",
        "--lora: not an override; write --section.key value (-h lists the keys)",
    ]
    assert _errors("--task.sub", "2", "--training.steps.x", "1", toml={"task": {"sub": {"k": 1}}}) == [
        "--task.sub: [task.sub] is a table: override its keys, --task.sub.KEY VALUE",
        "--training.steps.x: [training] steps is not a table: write --training.steps VALUE",
    ]


def test_a_free_form_table_takes_only_the_keys_its_toml_sets() -> None:
    toml = {"task": {"n": 2, "on": True}}
    assert _errors("--task.n", "x", "--task.m", "1", "--task.on", "--task.no-on", toml=toml) == [
        "--task.n 'x': [task] n must be an integer",
        "--task.m: [task] sets no 'm' in the TOML; an override changes a key that the TOML's [task] sets: "
        "add `m = ...` there",
    ]


@dataclasses.dataclass
class _Checked:
    steps: int = 1

    def __post_init__(self) -> None:
        if self.steps == 0:
            raise ValueError("steps must be positive or -1")


# Made at run time: this module's annotations are strings, and a schema's section types must be classes.
_Schema = dataclasses.make_dataclass("_Schema", [("section", _Checked, dataclasses.field(default_factory=_Checked))])


def test_a_section_s_own_check_is_a_config_error_naming_it() -> None:
    with pytest.raises(ConfigError, match=r"^\[section\] steps must be positive or -1$"):
        build_config(_Schema, {"section": {"steps": 1}}, {"section": {"steps": 0}})
    assert build_config(_Schema, {"section": {"steps": 1}}, {}).section.steps == 1


def test_toml_errors_and_override_errors_come_together_before_anything_is_parsed(tmp_path) -> None:
    config = tmp_path / "job.toml"
    config.write_text('[lora]\nrank = "x"\n')
    with pytest.raises(ConfigError) as err:
        parse_job(["--job.config-file", str(config), "--lora.rnak", "3"])  # either spelling of config_file
    assert err.value.errors == ['[lora] rank = "x" must be an integer (the default is rank = 16)',
                                "--lora.rnak: [lora] has an unknown key 'rnak'; did you mean 'rank'?"]


def test_torchtitan_0_2_2_keys_titan_lora_does_not_honour_are_refused_with_the_reason(tmp_path) -> None:
    """Accepted and ignored before: now each names why and the fix, from the TOML and from the command line."""
    config = tmp_path / "job.toml"
    config.write_text('[model]\ntokenizer_path = "/tok"\n[checkpoint]\nasync_mode = "async"\n[metrics]\nlog_freq = 5\n')
    with pytest.raises(ConfigError) as err:
        parse_job(["--job.config_file", str(config), "--training.dtype", "bfloat16", "--quantize.linear.x", "1"])
    assert err.value.errors == [
        "[model] tokenizer_path is torchtitan 0.2.2's key, which titan_lora does not take: torchtitan 0.2.2 "
        "deprecated it: write hf_assets_path (the tokenizer's directory); delete the line",
        "[checkpoint] async_mode is torchtitan 0.2.2's key, which titan_lora does not take: titan_lora saves its "
        "own DCP checkpoints ([checkpoint] enable, folder, interval, keep_latest_k) and resumes from the newest "
        "in folder; delete the line",
        "[metrics] is torchtitan 0.2.2's section, which titan_lora does not take: titan_lora logs every metric "
        "to TensorBoard under [job] dump_folder/tb; delete the section",
        "--training.dtype: [training] dtype is torchtitan 0.2.2's key, which titan_lora does not take: "
        "[training] mixed_precision_param is FSDP's compute dtype and [lora] dtype the adapters'; delete the line",
        "--quantize.linear.x: [quantize] is torchtitan 0.2.2's section, which titan_lora does not take: "
        "titan_lora's LoRA linears are not quantized; delete the section",
    ]


def test_every_torchtitan_0_2_2_key_is_kept_or_refused_and_every_refused_one_is_torchtitans() -> None:
    """No torchtitan 0.2.2 key (RECORD's list of its JobConfig) falls through as a bare "unknown key", and the
    refused list names no key of ours."""
    from titan_lora.run_sections import DROPPED_KEYS, DROPPED_SECTIONS

    ours = {f.name: f.type for f in dataclasses.fields(config_schema())}
    titan = {section: set(keys) for section, keys in RECORD["torchtitan_0_2_2_keys"].items()}
    for section, keys in titan.items():
        if section in DROPPED_SECTIONS:
            assert section not in ours
            continue
        kept = {f.name for f in dataclasses.fields(ours[section])}
        for key in keys:
            assert (key in kept) != ((section, key) in DROPPED_KEYS), (section, key)
    assert all(key in titan[section] for section, key in DROPPED_KEYS)
    assert set(DROPPED_SECTIONS) <= set(titan)


def test_flags_are_known_without_the_toml() -> None:
    assert is_flag("--parallelism.disable_loss_parallel") and is_flag("--lora.no-replicate-adapters")
    assert not is_flag("--lora.rank") and not is_flag("--task.on") and not is_flag("--nproc")


def test_help_lists_every_section_and_key_with_its_default(capsys) -> None:
    text = help_text(config_schema(), "usage: x")
    assert text.startswith("usage: x\n")
    assert "  --lora.rank  an integer (default: 16)" in text.splitlines()
    assert "  --task.KEY  the keys its TOML table sets" in text
    with pytest.raises(SystemExit) as done:
        parse_job(["--job.config_file", "missing.toml", "--help"])
    assert done.value.code == 0 and "  --grpo.loop  a string (default: \"sync\")" in capsys.readouterr().out

"""titan_lora's own config parse (TOML plus `--section.key value` overrides, no tyro): the same config as
torchtitan 0.2.2's ConfigManager gave, and the overrides it refused refused by name."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
from torchtitan.config import ConfigManager

from titan_lora.config import ConfigError
from titan_lora.trainer.job_config import config_schema, is_flag, parse_job
from titan_lora.trainer.toml_config import help_text, parse_overrides

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted(str(p.relative_to(REPO)) for p in (REPO / "train_configs").rglob("*.toml"))
OVERRIDES = {
    "none": [],
    "int, float, str, spelled with = and with -": ["--training.steps", "3", "--optimizer.lr=1e-4",
                                                   "--job.description", "x y", "--weight-sync.keep-versions=4"],
    "flags": ["--parallelism.disable_loss_parallel", "--lora.no_replicate_adapters", "--checkpoint.no-enable",
              "--compile.enable"],
    "lists": ["--model.converters", "lora", "--compile.components=model,loss", "--lora.target_modules", "wq,wv",
              "--parallelism.module_fqns_per_model_part", "a,b", "c"],
    "None, Literal, float | int, nested section": [
        "--debug.seed", "None", "--checkpoint.initial_load_path", "None", "--lr_scheduler.decay_ratio", "0.5",
        "--training.mixed_precision_param", "bfloat16", "--training.max_norm", "2",
        "--quantize.linear.float8.recipe_name", "rowwise", "--training.dataloader.num-workers", "2"],
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


def _torchtitans(argv: list[str]) -> dict:
    config = ConfigManager().parse_args([*argv, "--job.custom_config_module=titan_lora.config"])
    config.job.custom_config_module = ""  # the merge module it was told; the new parse merges by schema
    return _typed(dataclasses.asdict(config))


def _ours(argv: list[str]) -> dict:
    return _typed(dataclasses.asdict(parse_job(argv)[0]))


@pytest.mark.parametrize("overrides", list(OVERRIDES))
@pytest.mark.parametrize("config", SHIPPED)
def test_every_shipped_config_parses_as_torchtitan_0_2_2_parsed_it(config: str, overrides: str, monkeypatch) -> None:
    """The no-behaviour-change guarantee of the switch to our own parser: the same config, key by key and
    type by type, as torchtitan 0.2.2's ConfigManager (TOML + tyro) gave. It needs torchtitan 0.2.2's
    ConfigManager, so it goes at the switch to 0.3.0 (which has no TOML)."""
    monkeypatch.chdir(REPO)
    logging.getLogger().setLevel(logging.ERROR)  # torchtitan's asset warnings
    argv = ["--job.config_file", config, *OVERRIDES[overrides]]
    assert _ours(argv) == _torchtitans(argv)


def test_a_free_form_table_is_overridden_as_torchtitan_0_2_2_did(tmp_path) -> None:
    """[task]: only the keys its TOML sets, each typed by its TOML value (removed with the test above)."""
    config = tmp_path / "task.toml"
    config.write_text(TASK_TOML)
    for overrides in ([], TASK_OVERRIDES):
        argv = ["--job.config_file", str(config), *overrides]
        assert _ours(argv) == _torchtitans(argv)
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
    assert _errors("--training.dataloader", "2", "--training.steps.x", "1") == [
        "--training.dataloader: [training.dataloader] is a table: override its keys, --training.dataloader.KEY VALUE",
        "--training.steps.x: [training] steps is not a table: write --training.steps VALUE",
    ]


def test_a_free_form_table_takes_only_the_keys_its_toml_sets() -> None:
    toml = {"task": {"n": 2, "on": True}}
    assert _errors("--task.n", "x", "--task.m", "1", "--task.on", "--task.no-on", toml=toml) == [
        "--task.n 'x': [task] n must be an integer",
        "--task.m: [task] sets no 'm' in the TOML; an override changes a key that the TOML's [task] sets: "
        "add `m = ...` there",
    ]


def test_a_section_s_own_check_is_a_config_error_naming_it(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"^\[parallelism\] context_parallel_load_balancer cannot be an empty"):
        parse_job(["--parallelism.context_parallel_load_balancer="])
    with pytest.raises(ConfigError, match=r"^\[validation\] validation steps must be positive or -1$"):
        parse_job(["--validation.steps", "0"])


def test_toml_errors_and_override_errors_come_together_before_anything_is_parsed(tmp_path) -> None:
    config = tmp_path / "job.toml"
    config.write_text('[lora]\nrank = "x"\n')
    with pytest.raises(ConfigError) as err:
        parse_job(["--job.config-file", str(config), "--lora.rnak", "3"])  # either spelling of config_file
    assert err.value.errors == ['[lora] rank = "x" must be an integer (the default is rank = 16)',
                                "--lora.rnak: [lora] has an unknown key 'rnak'; did you mean 'rank'?"]


def test_the_deprecated_tokenizer_path_replaces_hf_assets_path_as_torchtitan_did(caplog) -> None:
    with caplog.at_level(logging.WARNING):
        config = parse_job(["--model.tokenizer_path", "/some/tokenizer"])[0]
    assert config.model.hf_assets_path == "/some/tokenizer"
    assert "tokenizer_path is deprecated" in caplog.text


def test_flags_are_known_without_the_toml() -> None:
    assert is_flag("--parallelism.disable_loss_parallel") and is_flag("--lora.no-replicate-adapters")
    assert not is_flag("--lora.rank") and not is_flag("--task.on") and not is_flag("--nproc")


def test_help_lists_every_section_and_key_with_its_default(capsys) -> None:
    text = help_text(config_schema(), "usage: x")
    assert text.startswith("usage: x\n")
    assert "  --lora.rank  an integer (default: 16)" in text.splitlines()
    assert "[training.dataloader]" in text and "  --task.KEY  the keys its TOML table sets" in text
    with pytest.raises(SystemExit) as done:
        parse_job(["--job.config_file", "missing.toml", "--help"])
    assert done.value.code == 0 and "  --grpo.loop  a string (default: \"sync\")" in capsys.readouterr().out

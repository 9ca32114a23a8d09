"""`[[adapters]]`: a config without tables is the one-adapter job it always was; one table sets its keys over
the sections'; every mistake in a table is one line naming the table and the key, with the section's fix."""

from __future__ import annotations

import dataclasses

import pytest
from model_helpers import DEBUG_LORA

from titan_lora import cli
from titan_lora.config_adapters import FALLBACK, Adapter, job_adapters, resolved_adapters, section_key
from titan_lora.trainer.job_config import job_config_from_toml

BASE = DEBUG_LORA + "[optimizer]\nlr = 3e-4\n"


def _sections(cfg) -> dict:
    return {name: dataclasses.asdict(getattr(cfg, name)) for name in ("lora", "optimizer", "training", "grpo",
                                                                       "weight_sync")}


def test_without_tables_the_job_is_its_sections_named_lora_name() -> None:
    cfg = job_config_from_toml(BASE)
    assert cfg.adapters == []
    (adapter,) = job_adapters(cfg)
    assert adapter.name == "policy" and adapter.lr == 3e-4 and adapter.rank == cfg.lora.rank
    assert adapter.data_path == cfg.data.path and adapter.data_seed == cfg.data.seed
    assert all(getattr(adapter, key) == getattr(getattr(cfg, section), section_key(key))
               for key, section in FALLBACK.items())


def test_one_table_sets_its_keys_over_the_sections_and_names_the_versions() -> None:
    plain = job_config_from_toml(BASE)
    cfg = job_config_from_toml(BASE + '[[adapters]]\nname = "math"\nrank = 4\nlr = 1e-3\ntask_ops = "+-*"\n')
    changed = {(s, k) for s in _sections(cfg) for k, v in _sections(cfg)[s].items() if v != _sections(plain)[s][k]}
    assert changed == {("lora", "rank"), ("optimizer", "lr"), ("grpo", "task_ops"), ("weight_sync", "lora_name")}
    assert (cfg.lora.rank, cfg.optimizer.lr, cfg.grpo.task_ops, cfg.weight_sync.lora_name) == (4, 1e-3, "+-*", "math")
    assert cfg.lora.alpha == plain.lora.alpha  # left out: the section's


def test_each_adapter_falls_back_key_by_key() -> None:
    sections = {"lora": type("L", (), {"rank": 16, "alpha": 32.0, "use_rslora": False, "dropout": 0.0,
                                       "target_modules": "all-linear"})(),
                "optimizer": type("O", (), {"lr": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8,
                                            "weight_decay": 0.1})(),
                "training": type("T", (), {"max_norm": 1.0})(),
                "grpo": type("G", (), {"task": "arith", "reward": "", "seed": 0, "temperature": 1.0,
                                       "task_digits": 1, "task_ops": "+-", "train_size": 2000, "eval_size": 100})(),
                "data": type("D", (), {"path": "all.jsonl", "seed": 0})()}
    a, b = resolved_adapters([Adapter(name="a", rank=8), Adapter(name="b", lr=5e-4, target_modules=["wq"],
                                                                 data_path="b.jsonl")], sections, "policy")
    assert (a.rank, a.lr, a.target_modules, a.data_path, a.data_seed) == (8, 1e-4, "all-linear", "all.jsonl", 0)
    assert (b.rank, b.lr, b.target_modules, b.data_path) == (16, 5e-4, ["wq"], "b.jsonl")


MISTAKES = {
    "a misspelt key": ('[[adapters]]\nname = "a"\nrnak = 8\n',
                       "[adapters #1] has an unknown key 'rnak'; did you mean 'rank'?"),
    "a key of the wrong type": ('[[adapters]]\nname = "a"\nrank = "big"\n',
                                '[adapters #1] rank = "big" must be an integer'),
    "rank zero": ('[[adapters]]\nname = "a"\nrank = 0\n',
                  "[adapters #1] rank must be a positive integer, got 0; try rank = 16"),
    "a NaN learning rate": ('[[adapters]]\nname = "a"\nlr = nan\n',
                            "[adapters #1] lr must be a finite number, got nan"),
    "no name": ("[[adapters]]\nrank = 4\n", "[adapters #1] has no name: add name = \"...\""),
    "a name that cannot name a version": ('[[adapters]]\nname = "my adapter"\n',
                                          "[adapters #1] name = 'my adapter' must be 1-64 letters"),
    "a repeated name": ('[[adapters]]\nname = "a"\n[[adapters]]\nname = "a"\n',
                        "[adapters #2] name = 'a' is used by an earlier table"),
    "a table written as a section": ('[adapters]\nname = "a"\n',
                                     "adapters must be an array of tables: write [[adapters]] above each one's keys"),
    "a target no linear has, in one of several tables": (
        '[[adapters]]\nname = "a"\n[[adapters]]\nname = "b"\ntarget_modules = ["nope"]\n',
        "[[adapters]] 'b': target_modules ['nope'] match no linear layer of this model"),
}


def test_several_adapters_take_the_async_loop_the_kl_term_and_the_rollback(tmp_path) -> None:
    config = tmp_path / "job.toml"
    config.write_text(BASE + '[grpo]\nenabled = true\nloop = "async"\nkl_coef = 0.1\n'
                      '[weight_sync]\nenabled = true\n[checkpoint]\nenable = true\n'
                      '[[adapters]]\nname = "a"\n[[adapters]]\nname = "b"\n')
    assert cli.config_errors(str(config), ["--training.on_nonfinite", "rollback"]) == []


def test_several_adapters_with_an_agent_task_are_refused_naming_the_table(tmp_path) -> None:
    config = tmp_path / "job.toml"
    config.write_text(BASE + '[grpo]\nenabled = true\n[weight_sync]\nenabled = true\n'
                      '[[adapters]]\nname = "a"\n[[adapters]]\nname = "b"\ntask = "calculator_agent"\n')
    assert cli.config_errors(str(config), []) == [
        "[[adapters]] 'b': task = 'calculator_agent' runs agent episodes, which several adapters do not train "
        "yet: set a task of one completion, or keep one table"]


@pytest.mark.parametrize("case", MISTAKES)
def test_each_mistake_in_a_table_is_one_line_naming_it(case: str, tmp_path) -> None:
    text, expected = MISTAKES[case]
    config = tmp_path / "job.toml"
    config.write_text(BASE + text)
    errors = cli.config_errors(str(config), [])
    assert len(errors) == 1 and expected in errors[0], errors


def test_tables_are_not_overridden_on_the_command_line(tmp_path) -> None:
    config = tmp_path / "job.toml"
    config.write_text(BASE + '[[adapters]]\nname = "a"\n')
    errors = cli.config_errors(str(config), ["--adapters.rank", "4"])
    assert errors == ["--adapters.rank: [[adapters]] tables are set in the TOML only: edit them there"], errors

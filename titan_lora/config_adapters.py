"""`[[adapters]]`: the LoRA adapters of a job, one TOML table each. A key a table leaves out comes from the
section that holds it for a one-adapter job (`FALLBACK`: [lora], [optimizer], [training], [grpo] or [data]); a
config with no table is one adapter made of those sections, named `[weight_sync] lora_name`, exactly as before."""

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass

from titan_lora.config_ranges import range_error

FALLBACK: dict[str, str] = {
    "rank": "lora", "alpha": "lora", "use_rslora": "lora", "dropout": "lora", "target_modules": "lora",
    "lr": "optimizer", "beta1": "optimizer", "beta2": "optimizer", "eps": "optimizer", "weight_decay": "optimizer",
    "max_norm": "training",
    "task": "grpo", "reward": "grpo", "seed": "grpo", "temperature": "grpo", "task_digits": "grpo",
    "task_ops": "grpo", "train_size": "grpo", "eval_size": "grpo",
    "data_path": "data", "data_seed": "data",
}
"""Each per-adapter key -> the section whose key it defaults to (`section_key` names that key)."""

RENAMED = {"data_path": "path", "data_seed": "seed"}
"""Per-adapter keys whose section key has another name ([data] path, not [data] data_path)."""


def section_key(key: str) -> str:
    """The name, in its `FALLBACK` section, of per-adapter key `key`."""
    return RENAMED.get(key, key)

ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
"""An adapter's name: it names its engine versions (`<name>-v<step>`), its export folder and its metrics."""


@dataclass
class Adapter:
    """`[[adapters]]`: one LoRA adapter of the job; a key left out takes its value from the section named."""

    name: str = ""
    """The adapter's name (letters, digits, `_.-`; unique): its engine versions are `<name>-v<step>`."""
    rank: int | None = None
    """LoRA rank; unset: [lora] rank."""
    alpha: float | None = None
    """LoRA alpha; unset: [lora] alpha."""
    use_rslora: bool | None = None
    """Rank-stabilized scale; unset: [lora] use_rslora."""
    dropout: float | None = None
    """Dropout on the adapter's input; unset: [lora] dropout."""
    target_modules: list[str] | str | None = None
    """The linears to adapt; unset: [lora] target_modules."""
    lr: float | None = None
    """Peak learning rate; unset: [optimizer] lr."""
    beta1: float | None = None
    """Adam beta1; unset: [optimizer] beta1."""
    beta2: float | None = None
    """Adam beta2; unset: [optimizer] beta2."""
    eps: float | None = None
    """Adam epsilon; unset: [optimizer] eps."""
    weight_decay: float | None = None
    """Weight decay; unset: [optimizer] weight_decay."""
    max_norm: float | None = None
    """The norm this adapter's gradients are clipped to (its own, not the job's); unset: [training] max_norm."""
    task: str | None = None
    """GRPO task; unset: [grpo] task."""
    reward: str | None = None
    """GRPO reward; unset: [grpo] reward."""
    seed: int | None = None
    """Seed of the task's problems and of the rollouts' sampling; unset: [grpo] seed."""
    temperature: float | None = None
    """Rollout sampling temperature; unset: [grpo] temperature."""
    task_digits: int | None = None
    """arith: digits per operand; unset: [grpo] task_digits."""
    task_ops: str | None = None
    """arith: the operators drawn from; unset: [grpo] task_ops."""
    train_size: int | None = None
    """Training problems the task draws; unset: [grpo] train_size."""
    eval_size: int | None = None
    """Held-out problems; unset: [grpo] eval_size."""
    data_path: str | None = None
    """SFT: the adapter's own JSONL of {"prompt", "completion"}; unset: [data] path."""
    data_seed: int | None = None
    """SFT: seed of the order the adapter's examples are drawn in; unset: [data] seed."""


def adapter_errors(adapters: list[Adapter]) -> list[str]:
    """One line per mistake in the `[[adapters]]` tables: a missing, malformed or repeated name, and any value
    its section would refuse (the same ranges and fixes)."""
    errors: list[str] = []
    seen: set[str] = set()
    for i, adapter in enumerate(adapters):
        where = f"[adapters #{i + 1}]"  # as the TOML checks name a table's keys
        if not adapter.name:
            errors.append(f'{where} has no name: add name = "..." (it names the adapter\'s engine versions)')
        elif not ADAPTER_NAME.fullmatch(adapter.name):
            errors.append(f"{where} name = {adapter.name!r} must be 1-64 letters, digits, '_', '.' or '-', starting "
                          "with a letter or digit")
        elif adapter.name in seen:
            errors.append(f"{where} name = {adapter.name!r} is used by an earlier table; each adapter needs its own name")
        seen.add(adapter.name)
        for key, section in FALLBACK.items():
            error = range_error(section, section_key(key), getattr(adapter, key))
            if error is not None:
                errors.append(f"{where} {error.removeprefix(f'[{section}] ').replace(section_key(key), key, 1)}")
    return errors


def resolved_adapters(adapters: list[Adapter], sections: Mapping[str, object], default_name: str) -> list[Adapter]:
    """Every adapter of the job with no key unset: each table's keys over its sections' (`sections`: the
    section name -> the parsed section); no table: one adapter, the sections', named `default_name`."""
    tables = adapters or [Adapter(name=default_name)]
    return [dataclasses.replace(adapter, **{key: getattr(sections[section], section_key(key))
                                            for key, section in FALLBACK.items() if getattr(adapter, key) is None})
            for adapter in tables]


def adapter_section(adapter: Adapter, name: str, section: object) -> object:
    """Section `name` (its dataclass, `section`) with `adapter`'s own keys of it: `[lora]` as an export and an
    engine see that adapter (rank, alpha, targets, ...), `[grpo]` as its rollouts do (task, seed, ...)."""
    return dataclasses.replace(section, **{section_key(key): getattr(adapter, key) for key, owner in FALLBACK.items()
                                           if owner == name})


def adapter_lora(adapter: Adapter, lora: object) -> object:
    """`[lora]` (the `LoRA` section) with `adapter`'s own keys of it."""
    return adapter_section(adapter, "lora", lora)


def job_adapters(job_config: object) -> list[Adapter]:
    """Every adapter of the job (`JobConfig`), its keys resolved over the sections' (see `resolved_adapters`)."""
    sections = {name: getattr(job_config, name) for name in set(FALLBACK.values())}
    return resolved_adapters(job_config.adapters, sections, job_config.weight_sync.lora_name)

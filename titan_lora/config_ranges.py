"""The values each numeric key accepts (`RANGES`), checked by name on the TOML and on the parsed config;
every float key, in a range or not, must also be finite (NaN passes any comparison with a bound)."""

import dataclasses
import math
from dataclasses import dataclass


class ConfigError(ValueError):
    """One or more config errors, one line each (`errors`), found before anything starts."""

    def __init__(self, errors: list[str]) -> None:
        """`errors`: one self-contained line per mistake, naming the key and the fix."""
        super().__init__("\n".join(errors))
        self.errors = list(errors)


@dataclass(frozen=True)
class Range:
    """The values a numeric key accepts: `lo` <= value <= `hi` (None: unbounded; `*_open`: the bound
    itself excluded); `text` replaces the generated wording, `fix` says what to write instead."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    text: str = ""
    fix: str = ""

    def describe(self) -> str:
        """The accepted values in words, e.g. "> 0" or "in [0, 1)"."""
        if self.text:
            return self.text
        if self.lo is not None and self.hi is not None:
            return f"in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"
        if self.lo is not None:
            return f"{'>' if self.lo_open else '>='} {self.lo:g}"
        return f"{'<' if self.hi_open else '<='} {self.hi:g}"

    def holds(self, value: float) -> bool:
        """Whether `value` is accepted."""
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            return False
        return self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)


_POSITIVE = Range(0, lo_open=True)
_AT_LEAST_1 = Range(1)
_NON_NEGATIVE = Range(0)
_PORT = Range(0, 65535, fix="use a TCP port, or 0 to pick a free one")
MAX_TIMEOUT_S = 86400.0
"""The longest any one `*_timeout_s` may be: a day (each bounds one wait; the process-group timeout adds them)."""
_SECONDS = Range(0, MAX_TIMEOUT_S, lo_open=True, text=f"> 0 and <= {MAX_TIMEOUT_S:g} seconds (a day)")
RANGES: dict[tuple[str, str], Range] = {
    ("lora", "rank"): Range(1, text="a positive integer", fix="try rank = 16"),
    ("lora", "alpha"): Range(0, lo_open=True, fix="a common choice is 2 * rank"),
    ("lora", "dropout"): Range(0, 1, hi_open=True),
    ("engine", "port"): _PORT,
    ("service", "port"): _PORT,
    ("service", "max_adapters"): Range(2, fix="a service trains at least 2 adapters; raise it"),
    ("service", "max_adapters_per_key"): Range(0, fix="0 lets one key hold up to max_adapters"),
    ("service", "max_rank"): _AT_LEAST_1,
    ("service", "lora_alpha"): _POSITIVE,
    ("service", "max_request_tokens"): _AT_LEAST_1,
    ("service", "micro_batch_tokens"): _AT_LEAST_1,
    ("service", "max_queued"): _AT_LEAST_1,
    ("service", "session_timeout_s"): _SECONDS,
    ("engine", "tcp_port"): _PORT,
    ("engine", "max_model_len"): _AT_LEAST_1,
    ("engine", "kv_cache_gib"): _AT_LEAST_1,
    ("engine", "cpu_threads"): Range(0, fix="0 lets titan_lora use every core this process may use"),
    ("engine", "replicas"): Range(1, fix="start at least 1 engine (1 is one engine)"),
    ("weight_sync", "bucket_mb"): _AT_LEAST_1,
    ("weight_sync", "keep_versions"): Range(2, fix="keep at least 2 (max staleness 1 + 1) so that rollouts "
                                                   "pinned to the previous version can finish"),
    ("weight_sync", "timeout_s"): _SECONDS,
    ("weight_sync", "retire_timeout_s"): _SECONDS,
    ("weight_sync", "rollout_timeout_s"): _SECONDS,
    ("weight_sync", "health_timeout_s"): _SECONDS,
    ("weight_sync", "engine_start_timeout_s"): _SECONDS,
    ("weight_sync", "retries"): _NON_NEGATIVE,
    ("weight_sync", "engine_restarts"): _NON_NEGATIVE,
    ("weight_sync", "parity_every"): Range(0, fix="0 turns the probe off"),
    ("weight_sync", "parity_tolerance"): _POSITIVE,
    ("grpo", "prompts_per_step"): _AT_LEAST_1,
    ("grpo", "group_size"): Range(2, fix="GRPO needs >= 2 samples per prompt"),
    ("grpo", "max_new_tokens"): _AT_LEAST_1,
    ("grpo", "temperature"): Range(0, lo_open=True, fix="try temperature = 1.0 (samples the policy as trained)"),
    ("grpo", "kl_coef"): Range(0, fix="0 skips the KL term"),
    ("grpo", "max_staleness"): _NON_NEGATIVE,
    ("grpo", "stale_weight_cap"): Range(1, fix="1 weighs stale samples as fresh ones; try 2.0"),
    ("grpo", "task_digits"): _AT_LEAST_1,
    ("grpo", "train_size"): _AT_LEAST_1,
    ("grpo", "eval_size"): _NON_NEGATIVE,
    ("grpo", "eval_every"): Range(0, fix="0 turns evaluation off"),
    # The run's sections (run_sections): checked here before the LR scheduler or optimizer meets them.
    ("training", "steps"): Range(1, fix="the number of optimizer steps: try steps = 20"),
    ("training", "local_batch_size"): _AT_LEAST_1,
    ("training", "seq_len"): _AT_LEAST_1,
    ("training", "max_norm"): Range(0, lo_open=True, fix="the norm gradients are clipped to: try max_norm = 1.0"),
    ("optimizer", "lr"): Range(0, lo_open=True, fix="try lr = 2e-4 (a common LoRA rate)"),
    ("optimizer", "eps"): _POSITIVE,
    ("optimizer", "weight_decay"): _NON_NEGATIVE,
    ("optimizer", "beta1"): Range(0, 1, hi_open=True),
    ("optimizer", "beta2"): Range(0, 1, hi_open=True),
    ("lr_scheduler", "warmup_steps"): _NON_NEGATIVE,
    ("lr_scheduler", "decay_ratio"): Range(0, 1),
    ("lr_scheduler", "min_lr_factor"): Range(0, 1),
    ("lr_scheduler", "total_steps"): _AT_LEAST_1,
    ("checkpoint", "interval"): _AT_LEAST_1,
    ("checkpoint", "keep_latest_k"): _NON_NEGATIVE,
}
"""The range of every numeric key that has one (section, key); docs/config.md lists them."""


def range_error(section: str, key: str, value: object) -> str | None:
    """The error line of `[section] key = value` when it is not a finite number (any float key) or
    `RANGES` refuses it, else None."""
    rule = RANGES.get((section, key))
    # Wrong types are refused by name when the TOML is read; None means "derived" (e.g. decay_ratio).
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if not math.isfinite(value):  # NaN passes every comparison: a lower bound alone would accept it
        accepted = f" {rule.describe()}" if rule is not None else ""
        return f"[{section}] {key} must be a finite number{accepted}, got {value}" + (
            f"; {rule.fix}" if rule is not None and rule.fix else "")
    if rule is None or rule.holds(value):
        return None
    return f"[{section}] {key} must be {rule.describe()}, got {value}" + (f"; {rule.fix}" if rule.fix else "")


def range_errors(section: str, cfg: object) -> list[str]:
    """One line per key of `cfg` (section `section`, a dataclass or the free-form `[task]` table) that is
    not finite or is outside its range in `RANGES`."""
    if isinstance(cfg, list):  # an array of tables ([[adapters]]): its own check, config_adapters.adapter_errors
        return []
    values = cfg if isinstance(cfg, dict) else {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    found = (range_error(section, key, item) for key, value in values.items()
             for item in (value if isinstance(value, list) else [value]))
    return [e for e in found if e is not None]


def raise_range_errors(section: str, cfg: object) -> None:
    """`range_errors`, raised as one ConfigError."""
    errors = range_errors(section, cfg)
    if errors:
        raise ConfigError(errors)


def all_range_errors(job_config: object) -> list[str]:
    """`range_errors` of every section of a parsed JobConfig."""
    return [e for f in dataclasses.fields(job_config) for e in range_errors(f.name, getattr(job_config, f.name))]

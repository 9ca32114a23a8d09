"""Your own prompts (`[grpo] task = "jsonl"`): one JSON object per line, `{"prompt", "answer"}` and an
optional `"system"`, scored by the extraction mode `[task] extract` names.

    [task]
    path = "data/train.jsonl"
    heldout_path = "data/test.jsonl"   # or heldout_fraction = 0.1 (the default without a file)
    extract = "boxed"                  # last_number | boxed | exact
    instruction = "Put the final answer in \\boxed{}."

The held-out split is a separate file or a fraction of `path`'s distinct prompts, the same for every
`[grpo] seed`; no held-out prompt is ever trained on.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import random

from titan_lora.config import GRPO
from titan_lora.rl.extract import answer_error, check_mode, is_correct
from titan_lora.rl.task import Problem

logger = logging.getLogger(__name__)

DEFAULT_HELDOUT_FRACTION = 0.1
SPLIT_SEED = 0
"""The fraction split's shuffle: fixed, so that runs with different `[grpo] seed` share a held-out set."""
_LINE_FORMAT = 'each line must be one JSON object such as {"prompt": "What is 2 + 2?", "answer": "4"}'


def _record(obj: object, where: str, extract: str) -> Problem:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: a JSON {type(obj).__name__}, not an object; {_LINE_FORMAT}")
    for key in ("prompt", "answer"):
        if key not in obj:
            keys = ", ".join(sorted(obj)) or "none"
            raise ValueError(f'{where}: no "{key}" (keys: {keys}); {_LINE_FORMAT}')
    prompt, answer, system = obj["prompt"], obj["answer"], obj.get("system", "")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f'{where}: "prompt" must be a non-empty string, got {prompt!r}')
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise ValueError(f'{where}: "answer" must be a string or a number, got {answer!r}')
    if isinstance(answer, float) and not math.isfinite(answer):  # JSON's NaN and Infinity, or 1e400
        raise ValueError(f'{where}: "answer" is {answer}, not a finite number; write a finite number such '
                         "as 4")
    if not isinstance(system, str):
        raise ValueError(f'{where}: "system" must be a string when given, got {system!r}')
    if why := answer_error(extract, str(answer)):
        raise ValueError(f"{where}: {why}")
    return Problem(prompt, str(answer), system)


def _decoded(raw: bytes, where: str, first: bool) -> str:
    """One line of the file as text; a byte that is not UTF-8 is named with the fix."""
    try:
        return raw.decode("utf-8-sig" if first else "utf-8")  # a leading byte-order mark is dropped
    except UnicodeDecodeError as err:
        fix = "save the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8 in.jsonl > out.jsonl`)"
        raise ValueError(f"{where}: byte {err.start + 1} of the line ({raw[err.start]:#04x}) is not UTF-8; "
                         f"{fix}") from None


def read_jsonl(path: str, key: str, extract: str = "exact") -> list[Problem]:
    """The records of `path` (named by the config key `key`), each answer one that `extract` can match;
    errors name the file, the line and the fix."""
    if not os.path.isfile(path):
        raise ValueError(f"{key} = {path!r} is not a file (relative paths start at {os.getcwd()}); "
                         f"point it at a JSONL file: {_LINE_FORMAT}")
    out = []
    with open(path, "rb") as f:  # bytes: a line that is not UTF-8 is named by its number
        for n, raw in enumerate(f, start=1):
            where = f"{path}:{n}"
            line = _decoded(raw, where, first=n == 1)
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: not valid JSON ({err.msg} at column {err.colno}); "
                                 f"{_LINE_FORMAT}") from None
            out.append(_record(obj, where, extract))
    if not out:
        raise ValueError(f"{key} = {path!r} has no records; {_LINE_FORMAT}")
    return out


def _key(p: Problem) -> tuple[str, str]:
    return p.system, p.question


def split_by_fraction(records: list[Problem], fraction: float) -> tuple[list[Problem], list[Problem]]:
    """(train, held-out): a seeded `fraction` of the distinct prompts (at least one) is held out."""
    prompts = list(dict.fromkeys(_key(p) for p in records))
    random.Random(SPLIT_SEED).shuffle(prompts)
    held = set(prompts[: max(1, round(fraction * len(prompts)))])
    return [p for p in records if _key(p) not in held], [p for p in records if _key(p) in held]


@dataclasses.dataclass(frozen=True)
class JsonlTask:
    """Prompts and answers from JSONL files, rewarded 1.0 when the extracted answer is the reference."""

    train: tuple[Problem, ...]
    heldout: tuple[Problem, ...]
    extract: str = "last_number"
    instruction: str = ""

    def problems(self, n: int, seed: int) -> list[Problem]:
        """Up to `n` training records, a seeded sample."""
        return random.Random(seed).sample(list(self.train), min(n, len(self.train)))

    def split(self, n_train: int, n_heldout: int, seed: int) -> tuple[list[Problem], list[Problem]]:
        """Up to `n_train` training records (seeded) and the first `n_heldout` held-out ones."""
        return self.problems(n_train, seed), list(self.heldout[:n_heldout])

    def reward(self, completion: str, problem: Problem) -> float:
        """1.0 when the answer extracted from `completion` is the problem's answer, else 0.0."""
        return float(is_correct(self.extract, completion, str(problem.answer)))


def jsonl_task(cfg: GRPO, *, path: str, heldout_path: str = "", heldout_fraction: float | None = None,
               extract: str = "last_number", instruction: str = "") -> JsonlTask:
    """The task from `[task]`: files read and checked, the held-out split made, the batch sizes checked."""
    check_mode(extract, "[task] extract")
    records = read_jsonl(path, "[task] path", extract)
    if heldout_path and heldout_fraction is not None:
        raise ValueError("[task] sets both heldout_path and heldout_fraction; keep one (a file, or a "
                         "fraction of [task] path)")
    if heldout_path:
        heldout = read_jsonl(heldout_path, "[task] heldout_path", extract)
        held = {_key(p) for p in heldout}
        train = [p for p in records if _key(p) not in held]
        if len(train) < len(records):
            logger.info("[task] %d records of %s are in %s too: they are held out, not trained on",
                        len(records) - len(train), path, heldout_path)
    else:
        fraction = DEFAULT_HELDOUT_FRACTION if heldout_fraction is None else heldout_fraction
        if not 0.0 < fraction < 1.0:
            raise ValueError(f"[task] heldout_fraction = {fraction}: use a fraction in (0, 1) such as 0.1, "
                             "or heldout_path for a separate file")
        train, heldout = split_by_fraction(records, fraction)
    if len(train) < cfg.prompts_per_step:
        raise ValueError(f"[task] path = {path!r} leaves {len(train)} training records outside the held-out "
                         f"set, fewer than [grpo] prompts_per_step = {cfg.prompts_per_step}; add records, "
                         "lower prompts_per_step or hold out less")
    return JsonlTask(tuple(train), tuple(heldout), extract, instruction)

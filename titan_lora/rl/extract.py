"""Answer extraction, chosen by `[task] extract`: small pure functions from a completion to its answer.

Each mode pairs an extractor (completion -> answer text, or None when there is none) with the test
that compares it to the reference answer.
"""

from __future__ import annotations

import difflib
import operator
import re
from collections.abc import Callable
from decimal import Decimal, InvalidOperation

_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")
_BOXED = "\\boxed{"


def last_number(text: str) -> str | None:
    """The last number in `text`, thousands separators dropped ("1,234.5" -> "1234.5"), or None."""
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def boxed(text: str) -> str | None:
    """The contents of the last complete top-level `\\boxed{...}` (nested braces kept), or None."""
    found, i = None, text.find(_BOXED)
    while i >= 0:
        depth, j = 1, i + len(_BOXED)
        while j < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            j += 1
        if depth:  # unclosed (e.g. cut off by the token budget): no answer after it
            break
        found = text[i + len(_BOXED) : j - 1].strip()
        i = text.find(_BOXED, j)
    return found


def whole_text(text: str) -> str:
    """The completion itself, surrounding whitespace dropped."""
    return text.strip()


def _number(text: str) -> Decimal | None:
    """`text` as a finite number, or None. NaN, sNaN and Infinity are no numbers: `==` on sNaN raises,
    and NaN equals nothing."""
    try:
        value = Decimal(text.replace(",", ""))
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def same_value(got: str, want: str) -> bool:
    """Equal as finite numbers when both are ("7.0" == "7"), else equal up to whitespace."""
    a, b = _number(got), _number(want)
    if a is not None and b is not None:
        return a == b
    return " ".join(got.split()) == " ".join(want.split())


Extractor = Callable[[str], "str | None"]
MODES: dict[str, tuple[Extractor, Callable[[str, str], bool]]] = {
    "last_number": (last_number, same_value),
    "boxed": (boxed, same_value),
    "exact": (whole_text, operator.eq),
}


def check_mode(mode: str, key: str) -> None:
    """Raise, naming `key` and the known modes, when `mode` is not one."""
    if mode not in MODES:
        close = difflib.get_close_matches(mode, MODES, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"{key} = {mode!r} is not an extraction mode; use one of {', '.join(MODES)}{hint}")


def answer_error(mode: str, answer: str) -> str | None:
    """Why no completion could ever match the reference `answer` under `mode`, or None when one can."""
    if mode == "exact" or _number(answer) is not None:
        return None
    try:
        Decimal(answer.replace(",", ""))
    except InvalidOperation:  # text: `boxed` compares it as text, `last_number` never extracts it
        if mode != "last_number":
            return None
        return (f"the answer {answer!r} is not a number, and [task] extract = 'last_number' reads the "
                "completion's last number, so no completion can match it; write the answer as a number "
                "such as \"4\", or use extract = \"boxed\" or \"exact\" for text answers")
    return (f"the answer {answer!r} is not a finite number (NaN and Infinity equal no completion's number); "
            "write the answer as a finite number such as \"4\"")


def is_correct(mode: str, completion: str, answer: str) -> bool:
    """Whether the answer that `mode` extracts from `completion` is `answer`."""
    extract, same = MODES[mode]
    got = extract(completion)
    return got is not None and same(got, answer.strip())

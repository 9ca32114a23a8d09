"""SGLang 0.5.23's `/generate`, as titan_lora uses it: the request (io_struct.py GenerateReqInput, the fields
titan_lora sets) and the answer read from api/v1's GenerateResponse."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class GenerateReqInput:
    """The `/generate` fields titan_lora uses; `lora_path` is the adapter's served name.

    One request (`input_ids` a list of ints) or a batch (a list of lists: SGLang answers a list, in
    order); `sampling_params` is one dict for all, or one per prompt."""

    text: str | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    lora_path: str | None = None
    return_logprob: bool | None = None
    logprob_start_len: int | None = None


@dataclasses.dataclass(frozen=True)
class GenerateOutput:
    """One `/generate` answer, with per-token log-probs (`input_logprobs[0]` is None at position 0).

    SGLang serializes with orjson, which writes a non-finite float as null: a null log-prob anywhere
    else is read as -inf (a log-probability is never +inf).
    """

    text: str
    output_ids: list[int]
    output_logprobs: list[float]
    input_logprobs: list[float | None]
    finish_reason: Any
    weight_version: str | None


def _logprobs(entries: Sequence[Sequence[Any]] | None, first_is_none: bool) -> list[float | None]:
    """The log-probs out of SGLang's [logprob, token_id, text] triples, null read as -inf."""
    out: list[float | None] = [-math.inf if e[0] is None else float(e[0]) for e in entries or []]
    if first_is_none and out:
        out[0] = None  # the first prompt token has no log-prob at all
    return out


def generate_output(out: Mapping[str, Any], with_prompt: bool) -> GenerateOutput:
    """One answer of `/generate` (a GenerateResponse of api/v1)."""
    meta = out["meta_info"]
    return GenerateOutput(
        text=out.get("text", ""),
        output_ids=list(out.get("output_ids") or []),
        output_logprobs=_logprobs(meta.get("output_token_logprobs"), False),  # type: ignore[arg-type]
        input_logprobs=_logprobs(meta.get("input_token_logprobs"), with_prompt),
        finish_reason=meta.get("finish_reason"),
        weight_version=meta.get("weight_version"),
    )

"""SGLang 0.5.23's `/generate` for the conformance server, written from the wheel's source.

How 0.5.23 takes a body (entrypoints/http_server.py `generate_request`): FastAPI parses it into io_struct's
`GenerateReqInput` (a field it does not have is ignored), then `api_contract.generate_contract_error` decodes
it with api/v1's generated `GenerateRequest` codec: a type error, or an unknown key inside `sampling_params`,
is a 400 `{"error": "<serde text>"}`. The tokenizer manager then normalizes the batch and checks each
request's sampling params; a ValueError there is a 400 `{"error": {"message": ...}}`.

What it answers: a GenerateResponse (a list of them, in order, for a batch) whose `meta_info` carries
`finish_reason` ({"type": "length", "length": n} or {"type": "stop", "matched": token}),
`output_token_logprobs` / `input_token_logprobs` as [logprob, token_id, text] and `weight_version`.
Sampling as layers/sampler.py does it: greedy below temperature 1e-6 with `log_softmax(logits)`, else a draw
from `softmax(logits / T)` with `log` of that as the log-prob; `sampling_seed` only counts on a server with
`--enable-deterministic-inference`. A matched stop token (or EOS, unless `ignore_eos`) stays in `output_ids`
and leaves `text`.

The conformance server is stricter than SGLang where SGLang would fail later or silently: it refuses
GenerateReqInput fields and sampling params it does not model, and per-prompt lists whose length is not the
batch size (SGLang indexes past their end).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
from sglang_schemas import SCHEMAS, RefusedError

# io_struct.py GenerateReqInput (0.5.23): FastAPI drops any other top-level key.
REQ_FIELDS = frozenset(SCHEMAS["/generate"][1])
# api/v1 SamplingParams (_FIELDS_SamplingParams, in its order): any other key is refused.
SAMPLING_FIELDS = ("max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
                   "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n",
                   "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
                   "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias",
                   "sampling_seed", "custom_params", "beam_width", "watermark", "choice")
_SAMPLING_EPS = 1e-6


# ---- the api/v1 contract (api_types.py): serde's texts --------------------------------------------

def _unexpected(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"boolean `{'true' if v else 'false'}`"
    if isinstance(v, int):
        return f"integer `{v}`"
    if isinstance(v, float):
        return f"floating point `{v}`"
    if isinstance(v, str):
        return f'string "{v}"'
    return "sequence" if isinstance(v, list) else "map" if isinstance(v, dict) else type(v).__name__


class ContractError(Exception):
    """api_types.JsonContractError: the body violates the api/v1 schema."""


def _expect(ok: bool, v: Any, expected: str) -> Any:
    if not ok:
        raise ContractError(f"invalid type: {_unexpected(v)}, expected {expected}")
    return v


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _seq(v: Any, each: Callable[[Any], Any]) -> list:
    return [each(e) for e in _expect(isinstance(v, list), v, "a sequence")]


def _i64(v: Any) -> int:
    return _expect(_int(v), v, "i64")


def _or_list(each: Callable[[Any], Any], name: str) -> Callable[[Any], Any]:
    """api/v1's `XOrList`: one value or an array of them."""
    def decode(v: Any) -> Any:
        if isinstance(v, list):
            return _seq(v, each)
        try:
            return each(v)
        except ContractError:
            raise ContractError(f"invalid type: {_unexpected(v)}, expected a value or an array of values "
                                f"for {name}") from None
    return decode


def _bool(v: Any) -> bool:
    return _expect(isinstance(v, bool), v, "a boolean")


def _str(v: Any) -> str:
    return _expect(isinstance(v, str), v, "a string")


def _token_ids_or_list(v: Any) -> Any:
    _expect(isinstance(v, list), v, "a value or an array of values for TokenIdsOrList")
    if not v or isinstance(v[0], (int, float)) and not isinstance(v[0], bool):
        return _seq(v, _i64)
    return _seq(v, lambda e: _seq(e, _i64))


def _sampling(v: Any) -> dict:
    m = _expect(isinstance(v, dict), v, "struct SamplingParams")
    for key, x in m.items():
        if key not in SAMPLING_FIELDS:
            listed = ", ".join(f"`{f}`" for f in SAMPLING_FIELDS)
            raise ContractError(f"unknown field `{key}`, expected one of {listed}")
        if x is None:
            continue
        if key in ("max_new_tokens", "top_k", "min_new_tokens", "n", "sampling_seed", "stream_interval",
                   "beam_width"):
            _i64(x)
        elif key in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                     "repetition_penalty"):
            _expect(_int(x) or isinstance(x, float), x, "f64")
        elif key == "stop_token_ids":
            _seq(x, _i64)
        elif key in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
            _bool(x)
    return m


_DECODERS: dict[str, Callable[[Any], Any]] = {
    "rid": _or_list(_str, "StringOrList"), "text": _or_list(_str, "StringOrList"),
    "input_ids": _token_ids_or_list, "stream": _bool,
    "sampling_params": lambda v: _seq(v, _sampling) if isinstance(v, list) else _sampling(v),
    "return_logprob": _or_list(_bool, "BoolOrList"), "logprob_start_len": _or_list(_i64, "Int64OrList"),
    "top_logprobs_num": _or_list(_i64, "Int64OrList"), "return_text_in_logprobs": _bool,
    "lora_path": lambda v: _seq(v, lambda e: None if e is None else _str(e)) if isinstance(v, list) else _str(v),
}


def contract_error(body: Any) -> str | None:
    """api_contract.generate_contract_error for the fields modelled here (None: admitted)."""
    try:
        m = _expect(isinstance(body, dict), body, "struct GenerateRequest")
        for key, value in m.items():
            if key in _DECODERS and value is not None:
                _DECODERS[key](value)
    except ContractError as err:
        return str(err)
    return None


# ---- normalization (io_struct.py GenerateReqInput, sampling_params.py) ----------------------------

@dataclasses.dataclass(frozen=True)
class Item:
    """One request of a normalized batch."""

    input_ids: list[int]
    params: dict[str, Any]
    lora_path: str | None
    return_logprob: bool
    logprob_start_len: int


def _value_error(message: str) -> RefusedError:
    """A ValueError in the tokenizer manager: http_server's _create_error_response."""
    return RefusedError({"error": {"message": message}})


def normalize(body: dict, modelled: frozenset[str]) -> tuple[list[Item], bool]:
    """The batch as the tokenizer manager sees it, and whether it was a single request."""
    unmodelled = sorted(k for k in body if k in REQ_FIELDS and k not in modelled and body[k] not in (None, False))
    if unmodelled:
        raise RefusedError({"error": f"conformance: {unmodelled} are not modelled"})
    if body.get("input_ids") is None:
        raise _value_error("Either text, input_ids or input_embeds should be provided." if body.get("text") is None
                           else "the conformance server has no tokenizer: send input_ids")
    ids = body["input_ids"]
    if not ids:
        raise _value_error("input_ids cannot be empty.")
    single = isinstance(ids[0], int)
    batch = [ids] if single else ids

    def per_item(key: str, default: Any) -> list:
        value = body.get(key)
        if value is None:
            return [default] * len(batch)
        if not isinstance(value, list):
            return [value] * len(batch)
        if len(value) != len(batch):
            raise RefusedError({"error": f"conformance: {key} has {len(value)} entries for a batch of "
                                         f"{len(batch)}"})
        return value

    params = per_item("sampling_params", {})
    for p in params:
        _verify(p)
    items = [Item(list(i), p, lp, bool(rl), st) for i, p, lp, rl, st in zip(
        batch, params, per_item("lora_path", None), per_item("return_logprob", False),
        per_item("logprob_start_len", -1))]
    return items, single


_MODELLED_SAMPLING = {"max_new_tokens", "temperature", "stop_token_ids", "sampling_seed", "ignore_eos"}


def _verify(p: dict) -> None:
    """SamplingParams.verify for the params modelled here; others are refused."""
    others = sorted(k for k, v in p.items() if k not in _MODELLED_SAMPLING and v is not None)
    if others:
        raise RefusedError({"error": f"conformance: sampling params {others} are not modelled"})
    temperature = 1.0 if p.get("temperature") is None else p["temperature"]
    if not math.isfinite(temperature) or temperature < 0.0:
        raise _value_error(f"temperature must be a non-negative finite number, got {temperature}.")
    if p.get("max_new_tokens") is not None and p["max_new_tokens"] < 0:
        raise _value_error(f"max_new_tokens must be at least 0, got {p['max_new_tokens']}.")


# ---- sampling and the answer ----------------------------------------------------------------------

@torch.no_grad()
def complete(model: Any, item: Item, eos: set[int], deterministic: bool) -> tuple[list, list, dict]:
    """(prompt log-prob entries, output entries, finish_reason) of one request on `model`."""
    p = item.params
    max_new = 128 if p.get("max_new_tokens") is None else p["max_new_tokens"]
    temperature = 1.0 if p.get("temperature") is None else p["temperature"]
    stops = set(p.get("stop_token_ids") or ()) | (set() if p.get("ignore_eos") else eos)
    gen = None
    if deterministic and temperature >= _SAMPLING_EPS:  # sampling_batch_info.py: 42 when unset
        gen = torch.Generator().manual_seed(42 if p.get("sampling_seed") is None else p["sampling_seed"])
    ids = item.input_ids
    logits = model(torch.tensor([ids])).logits[0].float()
    prompt_lp = torch.log_softmax(logits, -1)
    out: list[list] = []
    finish: dict = {"type": "length", "length": max_new}
    last = logits[-1]
    while len(out) < max_new:
        if temperature < _SAMPLING_EPS:
            lp = torch.log_softmax(last, -1)
            tok = int(lp.argmax())
        else:
            lp = torch.log_softmax(last / temperature, -1)
            tok = int(torch.multinomial(lp.exp(), 1, generator=gen))
        out.append([float(lp[tok]), tok, None])
        if tok in stops:
            finish = {"type": "stop", "matched": tok}
            break
        if len(out) < max_new:  # no KV cache: recompute the whole sequence (the model is tiny)
            last = model(torch.tensor([ids + [e[1] for e in out]])).logits[0, -1].float()
    start = item.logprob_start_len
    inputs = [[None if i == start else float(prompt_lp[i - 1, t]), t, None] for i, t in enumerate(ids)]
    return (inputs[start:] if start >= 0 else []), out, finish


def answer(item: Item, inputs: list, out: list, finish: dict, rid: str, weight_version: str,
           decode: Callable[[list[int]], str] | None) -> dict:
    """One GenerateResponse, as tokenizer_manager builds it for a finished request."""
    ids = [e[1] for e in out]
    shown = ids[:-1] if finish["type"] == "stop" else ids  # detokenizer's trim_matched_stop
    meta = {"id": rid, "finish_reason": finish, "prompt_tokens": len(item.input_ids),
            "weight_version": weight_version, "num_retractions": 0, "reasoning_tokens": 0,
            "completion_tokens": len(out), "cached_tokens": 0, "e2e_latency": 0.0}
    if item.return_logprob:
        meta |= {"input_token_logprobs": inputs, "output_token_logprobs": out,
                 "output_token_logprobs_length": len(out)}
    return {"text": decode(shown) if decode is not None else "", "output_ids": ids, "meta_info": meta}

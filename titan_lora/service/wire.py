"""The protobuf half of the Tinker wire format: `forward_backward` requests in, their results and `sample`'s out.

The one module that imports the `tinker` SDK (its generated `tinker_public_pb2`, the schema the SDK writes and
reads; `.importlinter` fences it here). Everything else of the API is JSON (`routes`). Arrays are
little-endian in the dtype each message declares; a 2-D `target_tokens` or `weights` may come as sparse CSR.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from tinker.proto import tinker_public_pb2 as pb

_NUMPY = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


class WireError(ValueError):
    """A request body the service cannot read: the request fails with this message."""


@dataclass
class Datum:
    """One training example: its token ids and its loss inputs (each a flat array)."""

    tokens: np.ndarray
    inputs: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class ForwardBackward:
    """A decoded `forward_backward` (or `forward`: `forward_only`) request."""

    model_id: str
    seq_id: int
    loss_fn: str
    config: dict[str, float]
    forward_only: bool
    data: list[Datum]


def _tensor(msg: pb.Tensor, where: str) -> np.ndarray:
    dtype = _NUMPY.get(msg.dtype)
    if dtype is None:
        raise WireError(f"{where}: tensor dtype {msg.dtype} is not float32 or int64")
    shape = tuple(msg.shape)
    if msg.WhichOneof("encoding") == "sparse_csr":
        csr = msg.sparse_csr
        if len(shape) != 2:
            raise WireError(f"{where}: a sparse tensor needs a 2-D shape, got {list(shape)}")
        dense = np.zeros(shape, dtype=dtype)
        crow = np.frombuffer(csr.crow_indices, dtype=np.int64)
        cols = np.frombuffer(csr.col_indices, dtype=np.int64)
        values = np.frombuffer(csr.values, dtype=dtype)  # copied into `dense`
        if len(crow) != shape[0] + 1 or len(cols) != len(values) or (len(cols) and cols.max() >= shape[1]):
            raise WireError(f"{where}: its sparse CSR indices do not fit shape {list(shape)}")
        for row in range(shape[0]):
            dense[row, cols[crow[row]:crow[row + 1]]] = values[crow[row]:crow[row + 1]]
        return dense
    flat = np.frombuffer(msg.dense, dtype=dtype).copy()
    if shape and int(np.prod(shape)) != flat.size:
        raise WireError(f"{where}: {flat.size} values for shape {list(shape)}")
    return flat.reshape(shape) if shape else flat


def _tokens(datum: pb.Datum, index: int) -> np.ndarray:
    parts = []
    for chunk in datum.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise WireError(f"datum {index}: a {kind} chunk; titan_lora serves text models (encoded_text chunks)")
        parts.append(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32))
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)


def read_forward_backward(body: bytes) -> ForwardBackward:
    """The request the SDK serialised (`ForwardBackwardRequest`), as arrays."""
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as err:  # protobuf raises its own DecodeError, or others on bad bytes
        raise WireError(f"the forward_backward body is not a ForwardBackwardRequest protobuf: {err}") from err
    config = {key: value.number for key, value in msg.loss_fn_config_v2.items() if value.HasField("number")}
    config = config or dict(msg.loss_fn_config)
    data = [Datum(_tokens(d, i), {key: _tensor(t, f"datum {i} loss_fn_inputs[{key!r}]")
                                  for key, t in d.loss_fn_inputs.items()})
            for i, d in enumerate(msg.data)]
    return ForwardBackward(msg.model_id, msg.seq_id, msg.loss_fn, config, msg.forward_only, data)


def write_forward_backward(logprobs: list[np.ndarray], metrics: dict[str, float]) -> bytes:
    """A `ForwardBackwardOutput`: each datum's target log-probs (float32, in request order) and the metrics
    (each named `name:reduction`, which the SDK merges by)."""
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    record = out.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(logprobs))
    parts = [np.ascontiguousarray(lp, dtype=np.float32) for lp in logprobs]
    offsets = np.cumsum([0] + [p.nbytes for p in parts], dtype=np.int64)
    batched = record.fields["logprobs"]
    batched.data = b"".join(p.tobytes() for p in parts)
    batched.offsets = offsets.tobytes()
    batched.dtype = pb.DTYPE_FLOAT32
    for key, value in metrics.items():
        out.metrics[key] = float(value)
    return out.SerializeToString()


@dataclass
class SampledTokens:
    """One sampled sequence as `sample` returns it: its tokens, their log-probs, and why it stopped."""

    tokens: list[int]
    logprobs: list[float]
    stopped: bool
    topk: list[list[tuple[int, float]]] | None = None


TopK = list[list[tuple[int, float]] | None]
"""Per position, up to k (token id, log-prob), likeliest first; None where none was computed."""
TOPK_PAD = (0, -99999.0)
"""The SDK's filler of a top-k matrix (`tinker.types.topk_logprobs.MASK_LOGPROB`): token 0, log-prob -99999."""


def write_sample(sequences: list[SampledTokens], prompt_logprobs: list[float | None] | None = None,
                 prompt_topk: TopK | None = None, prompt_k: int = 0, sample_k: int = 0) -> bytes:
    """A `SampleResponse`: the sequences in order (each with a log-prob per token, which the SDK's RL loops
    require, and its top `sample_k` when asked) and, when asked, one log-prob per prompt token (NaN for the
    first) and the prompt's top `prompt_k`."""
    out = pb.SampleResponse()
    for seq in sequences:
        added = out.sequences.add(stop_reason=pb.STOP_REASON_STOP if seq.stopped else pb.STOP_REASON_LENGTH,
                                  tokens=np.asarray(seq.tokens, dtype=np.int32).tobytes(),
                                  logprobs=np.asarray(seq.logprobs, dtype=np.float32).tobytes())
        if seq.topk is not None:
            _write_topk(added.topk_sampled_logprobs, seq.topk, sample_k)
    if prompt_logprobs is not None:
        out.prompt_logprobs = np.asarray([np.nan if v is None else v for v in prompt_logprobs],
                                         dtype=np.float32).tobytes()
    if prompt_topk is not None:
        _write_topk(out.topk_prompt_logprobs, prompt_topk, prompt_k)
    return out.SerializeToString()


def _write_topk(msg: pb.TopkLogprobs, rows: TopK, k: int) -> None:
    """`rows` as the SDK's dense (length, k) matrices, short and absent rows padded with `TOPK_PAD`."""
    token_ids = np.full((len(rows), k), TOPK_PAD[0], dtype=np.int32)
    logprobs = np.full((len(rows), k), TOPK_PAD[1], dtype=np.float32)
    for i, row in enumerate(rows):
        for j, (token, logprob) in enumerate(row or []):
            token_ids[i, j], logprobs[i, j] = token, logprob
    msg.token_ids, msg.logprobs, msg.k, msg.length = token_ids.tobytes(), logprobs.tobytes(), k, len(rows)

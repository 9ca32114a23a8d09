"""The trainer's log-probs of a batch's sampled tokens, in row chunks whose activations are bounded.

A GRPO step over agent episodes holds long sequences: one forward over all of a rank's rows was measured
at 7.4 GB on rank 0 for 4 x 8 calculator episodes. Above `LOGPROB_CHUNK_TOKENS` padded tokens, the rows
are split into chunks that run one forward each, cut to their own longest row; under autograd each chunk
is checkpointed (its activations are dropped and recomputed in the backward, one chunk at a time), so the
peak is one chunk's activations plus the [rows, width] log-probs, for one more forward of the batch.

With several adapters (`rows`: the batch's rows grouped by adapter) each forward runs under its rows' adapters
(`multi_rows.route`); a checkpointed chunk routes again when the backward recomputes it, and the rows stay
routed after the last forward, for the backward (the training loop unroutes after it).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from titan_lora.lora.multi_rows import AdapterRows, route
from titan_lora.titan.models import output_head

LOGPROB_CHUNK_TOKENS = 4096
"""Padded tokens (rows x width) one forward covers at most, unless one row is longer; below it a batch runs
in one forward, as every completion job's does (the main job: 32 rows x ~70 tokens a rank)."""


def token_logprobs(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor,
                   mask: torch.Tensor | None = None) -> torch.Tensor:
    """log p(label) at every position, [N, T]; with `mask`, only where it is set (0 elsewhere).

    With a mask, a model with a final `norm` and an output head (torchtitan's families) runs the head on the
    masked positions alone: the norm's output is cut to them, so the head's matmul and the [N, T, vocab]
    logits skip the prompt, which in GRPO is most of every sequence. Under TP the norm's output is a DTensor
    sharded over the sequence; it is left whole there and the logits cover every position."""
    keep = mask.bool() if mask is not None else None
    norm, handle = getattr(model, "norm", None), None
    if keep is not None and isinstance(norm, nn.Module) and output_head(model) is not None:
        handle = norm.register_forward_hook(lambda _m, _i, out: out if isinstance(out, DTensor) else out[keep])
    try:
        logits = model(inputs).float()
    finally:
        if handle is not None:
            handle.remove()
    cut = logits.dim() == 2  # [K, vocab]: the masked positions' logits, in row-major order
    chosen = labels[keep] if cut else labels
    logp = torch.gather(F.log_softmax(logits, dim=-1), -1, chosen[..., None]).squeeze(-1)
    return logp.new_zeros(labels.shape).masked_scatter(keep, logp) if cut else logp


def chunk_count(mask: torch.Tensor, max_tokens: int, group: dist.ProcessGroup | None = None) -> int:
    """How many row chunks keep a forward within `max_tokens` padded tokens (at most one per row); the
    largest over `group`, since every FSDP forward all-gathers: the ranks must run as many (they hold as
    many rows)."""
    rows, width = mask.shape
    chunks = torch.tensor(min(rows, max(1, math.ceil(rows * width / max_tokens))), device=mask.device)
    if group is not None:
        dist.all_reduce(chunks, op=dist.ReduceOp.MAX, group=group)
    return int(chunks)


def routed_token_logprobs(model: nn.Module, rows: AdapterRows | None, inputs: torch.Tensor, labels: torch.Tensor,
                          mask: torch.Tensor) -> torch.Tensor:
    """`token_logprobs` with `mask`, every row under its adapter (`rows`; None: a one-adapter model)."""
    if rows is not None:
        route(model, rows)  # left set: the backward (or a checkpoint's recompute) reads the same rows
    return token_logprobs(model, inputs, labels, mask)


def chunked_token_logprobs(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor,
                           chunks: int, rows: AdapterRows | None = None) -> torch.Tensor:
    """`token_logprobs` with `mask`, over `chunks` row blocks one forward each (checkpointed under autograd,
    see the module); the same values and gradients as one forward. `rows`: the adapter of each row, in a
    model with several."""
    if chunks <= 1:
        return routed_token_logprobs(model, rows, inputs, labels, mask)
    parts, start = [], 0
    for block in zip(inputs.tensor_split(chunks), labels.tensor_split(chunks), mask.tensor_split(chunks)):
        sampled = block[2].nonzero()
        width = int(sampled[:, 1].max()) + 1 if len(sampled) else 1  # causal: later positions change nothing
        cut = [t[:, :width] for t in block]
        own = None if rows is None else rows.within(start, start + len(block[0]))
        start += len(block[0])
        if torch.is_grad_enabled():
            logp = checkpoint(routed_token_logprobs, model, own, *cut, use_reentrant=False)
        else:
            logp = routed_token_logprobs(model, own, *cut)
        parts.append(F.pad(logp, (0, labels.shape[1] - width)))
    return torch.cat(parts)

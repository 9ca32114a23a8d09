"""K LoRA adapters on one linear: the base runs once for the whole batch, each row adds its adapter's delta.

y[rows of k] = base(x)[rows of k] + scale_k * dropout(x[rows of k]) A_k^T B_k^T, for each adapter k that
targets the linear (one that does not adds nothing there). The rows arrive sorted by adapter (`multi_rows`),
so each adapter's rows are one contiguous slice and its delta is the single-adapter path's two matmuls on
that slice, added in place: A_k and B_k get gradients from adapter k's rows only, and a NaN in one adapter's
rows stays in that adapter. Each adapter's A and B are separate parameters at its own rank, `lora_A_<k>`
(rank_k x in) and `lora_B_<k>` (out x rank_k): FSDP2 shards them and the optimizer groups them per adapter.
Every adapter of the linear runs on every batch, one with no rows on an empty slice, so every data-parallel
rank produces a gradient (zero for no rows) for the same parameters and FSDP2's reduce-scatters match.

A per-segment loop, not `torch._grouped_mm`: grouped_mm takes one stacked weight, so adapters of different
ranks are padded to the largest (ranks 8/16/32/64 compute 256 rank units instead of 120); on CPU it also needs
16-byte-aligned strides and refuses the zero-stride gradient of a plain `.sum()`. Measured on SmolLM2 shapes
(`scripts/bench_multi_lora.py`, figures in docs/multi_adapter.md): with mixed ranks the loop is as fast or
faster, and each segment's arithmetic is exactly the single-adapter path's.

On a GPU the loop's cost is the host's: K adapters issue about K times a one-adapter step's ops, and with few
rows an adapter the GPU waits on them (an 8-adapter step of 2048 tokens took 221 ms where one adapter's 2048
tokens took 58 ms, docs/benchmarks.md row 31). There, when every adapter targets the linear at one rank and
holds as many rows as the others, as a GRPO step's adapters do, the deltas are two batched matmuls over the
stacked adapters (`batched_delta`): a handful of ops whatever K. Its sums run in another order than the loop's.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from titan_lora.lora.multi_rows import AdapterRows, ReadsAdapterRows

_MULTI_NAME = re.compile(r"lora_[AB]_(\d+)")


@dataclass(frozen=True)
class AdapterShape:
    """One adapter's shape on one linear: its rank and its scale (`lora_scale(rank, alpha, use_rslora)`)."""

    rank: int
    scale: float


class MultiLoRALayer(ReadsAdapterRows):
    """The K-adapter half of a LoRA linear, mixed in before the linear's own class (`multi_lora_class`)."""

    num_adapters: int
    adapter_scales: dict[int, float]  # adapter -> scale, for the adapters that target this linear
    lora_dropout_p: float
    training: bool  # nn.Module's, from the linear's class after this mixin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Base projection over all rows, plus each adapter's scaled low-rank path on its own rows."""
        rows = self.adapter_rows
        if rows is None:
            raise RuntimeError("a multi-adapter linear ran outside multi_rows.routed(model, rows): run the "
                               "forward and backward inside it, with the batch's rows grouped by group_rows")
        rows.check(x.shape[0], self.num_adapters)
        base = super().forward(x)  # type: ignore[misc]  (the linear's own)
        dropped = F.dropout(x, self.lora_dropout_p, self.training) if self.lora_dropout_p else x
        if x.is_cuda and self._stackable(rows):
            return base + batched_delta(dropped, *self._factors(), self._scales_as(x))
        offsets = rows.offsets
        for k, scale in self.adapter_scales.items():
            start, end = offsets[k], offsets[k + 1]
            a, b = getattr(self, f"lora_A_{k}"), getattr(self, f"lora_B_{k}")
            if start == end and isinstance(x, DTensor):
                # DTensor (torch 2.11) fails F.linear on an empty slice whose sequence length is uneven over the
                # TP mesh ("Cannot unflatten unevenly sharded tensor"). One real row, added times zero, keeps the
                # adapter in the graph: its gradients must exist (zero) on every rank, as FSDP reduce-scatters them.
                start, end, scale = 0, 1, 0.0
            update = F.linear(F.linear(dropped[start:end], a.to(x.dtype)), b.to(x.dtype))
            # In place on the segment, as the single-adapter path adds to the whole output.
            base[start:end].add_(update, alpha=scale)
        return base

    def _scales_as(self, x: torch.Tensor) -> torch.Tensor:
        """The adapters' scales as a (K, 1, 1) tensor on `x`'s device and dtype, made once per value (no host to
        device copy a step; the service rescales a slot when a client takes it)."""
        key = (x.device, x.dtype, tuple(self.adapter_scales.items()))
        cached = self.__dict__.get("_scale_tensor")
        if cached is None or cached[0] != key:  # only the latest: a rescaled slot replaces it
            cached = self.__dict__["_scale_tensor"] = (key, torch.tensor(
                [self.adapter_scales[k] for k in range(self.num_adapters)], dtype=x.dtype, device=x.device).view(-1, 1, 1))
        return cached[1]

    def _factors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Every adapter's A and B, in adapter order."""
        return ([getattr(self, f"lora_A_{k}") for k in range(self.num_adapters)],
                [getattr(self, f"lora_B_{k}") for k in range(self.num_adapters)])

    def _stackable(self, rows: AdapterRows) -> bool:
        """Every adapter here, at one rank, on plain (not TP-sharded) tensors, with as many rows as the others."""
        if len(self.adapter_scales) != self.num_adapters or len(set(rows.counts)) != 1 or not rows.counts[0]:
            return False
        a, _ = self._factors()
        return len({t.shape for t in a}) == 1 and all(type(t.data) is torch.Tensor for t in a)


def batched_delta(x: torch.Tensor, a: Sequence[torch.Tensor], b: Sequence[torch.Tensor],
                  scales: torch.Tensor) -> torch.Tensor:
    """Every adapter's scaled low-rank delta on its own equal share of `x`'s rows (adapter k: the k-th share),
    as two batched matmuls over the stacked adapters (all of one rank); `scales` is (K, 1, 1)."""
    shares = x.reshape(len(a), -1, x.shape[-1])  # adapter k's rows, flattened with their positions
    stacked_a = torch.stack([t.to(x.dtype) for t in a])  # (K, rank, in)
    stacked_b = torch.stack([t.to(x.dtype) for t in b])  # (K, out, rank)
    delta = torch.bmm(torch.bmm(shares, stacked_a.transpose(1, 2)), stacked_b.transpose(1, 2)) * scales
    return delta.reshape(*x.shape[:-1], delta.shape[-1])


@functools.cache
def multi_lora_class(linear_cls: type[nn.Linear]) -> type[nn.Linear]:
    """The K-adapter subclass of `linear_cls` (one per class)."""
    if issubclass(linear_cls, MultiLoRALayer):
        return linear_cls
    return type(f"MultiLoRA{linear_cls.__name__}", (MultiLoRALayer, linear_cls), {"__module__": __name__})


def add_adapters(linear: nn.Linear, shapes: Sequence[AdapterShape | None], dropout: float = 0.0,
                 dtype: torch.dtype = torch.float32) -> MultiLoRALayer:
    """Turn `linear` in place into its K-adapter subclass (same object, same weight): adapter k gets
    `shapes[k]` (None: k does not target this linear). A/B are uninitialised (`init_adapters`); call before
    sharding."""
    if not any(shapes):
        raise ValueError("add_adapters got no adapter for this linear: leave a linear no adapter targets "
                         "as it is")
    device = linear.weight.device
    linear.__class__ = multi_lora_class(type(linear))
    linear.num_adapters = len(shapes)
    linear.adapter_scales = {k: s.scale for k, s in enumerate(shapes) if s is not None}
    linear.lora_dropout_p = dropout
    for k, shape in enumerate(shapes):
        if shape is not None:
            setattr(linear, f"lora_A_{k}", nn.Parameter(torch.empty(shape.rank, linear.in_features,
                                                                    device=device, dtype=dtype)))
            setattr(linear, f"lora_B_{k}", nn.Parameter(torch.empty(linear.out_features, shape.rank,
                                                                    device=device, dtype=dtype)))
    return linear  # type: ignore[return-value]


def adapter_of(name: str) -> int | None:
    """The adapter a parameter name belongs to (`...lora_B_2` -> 2), None for any other parameter."""
    match = _MULTI_NAME.fullmatch(name.rsplit(".", 1)[-1])
    return int(match.group(1)) if match else None


def one_adapter_name(name: str) -> str:
    """A K-adapter parameter's name as a one-adapter model names it (`...wq.lora_B_2` -> `...wq.lora_B`)."""
    module, leaf = name.rsplit(".", 1)
    match = _MULTI_NAME.fullmatch(leaf)
    return f"{module}.{leaf.rsplit('_', 1)[0]}" if match else name


def param_pattern(adapter: int) -> str:
    """The regex, searched in a parameter's qualified name, that matches adapter `adapter`'s parameters."""
    return rf"\.lora_[AB]_{adapter}$"

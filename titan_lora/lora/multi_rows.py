"""Which adapter each row of a batch trains: rows grouped by adapter into contiguous segments, and the scope
in which every multi-adapter linear of a model reads them.

The rows are sorted once, on the host, where the batch is put together (`group_rows` gives the order): each
linear then slices its input instead of gathering and scattering rows (13-40% slower on CPU,
docs/multi_adapter.md). The segments reach the linears as an attribute set for the scope of `routed`, not as a
forward argument: torchtitan's decoder forward takes tokens only, and an attribute is still there when
activation checkpointing recomputes a block in the backward, on whatever thread runs it.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn


@dataclass(frozen=True)
class AdapterRows:
    """Rows per adapter, in adapter order: adapter k trains rows offsets[k]:offsets[k + 1]."""

    counts: tuple[int, ...]

    def __post_init__(self) -> None:
        if any(c < 0 for c in self.counts):
            raise ValueError(f"adapter row counts {self.counts} hold a negative count: each is a number of "
                             "rows")

    @property
    def offsets(self) -> tuple[int, ...]:
        """Segment boundaries: 0, then the running sum of the counts."""
        return (0, *itertools.accumulate(self.counts))

    def bounds(self, adapter: int) -> tuple[int, int]:
        """The first and one-past-last row of `adapter`'s segment."""
        offsets = self.offsets
        return offsets[adapter], offsets[adapter + 1]

    def within(self, start: int, stop: int) -> AdapterRows:
        """The segments of rows `start:stop` of the batch (a chunk of it), for the same adapters."""
        return AdapterRows(tuple(max(0, min(hi, stop) - max(lo, start))
                                 for lo, hi in zip(self.offsets, self.offsets[1:])))

    def check(self, rows: int, num_adapters: int) -> None:
        """Raise unless these segments cover a batch of `rows` rows for `num_adapters` adapters."""
        if len(self.counts) != num_adapters:
            raise ValueError(f"adapter rows give {len(self.counts)} counts for a model with {num_adapters} "
                             "adapters: pass one count per adapter (0 for an adapter with no rows)")
        if sum(self.counts) != rows:
            raise ValueError(f"adapter rows count {sum(self.counts)} rows for a batch of {rows}: group the "
                             "batch's own adapter indices with group_rows and reorder the batch by its order")


def group_rows(adapter_of_row: Sequence[int] | torch.Tensor,
               num_adapters: int) -> tuple[torch.Tensor, AdapterRows]:
    """The stable order that sorts a batch's rows by adapter, and the segments it makes.

    `batch[order]` (tokens, labels, masks alike) is the batch the model then runs inside `routed`."""
    index = torch.as_tensor(adapter_of_row, dtype=torch.int64).flatten().cpu()
    bad = index[(index < 0) | (index >= num_adapters)]
    if bad.numel():
        raise ValueError(f"row adapter index {int(bad[0])} is out of range for {num_adapters} adapters: "
                         f"each row names an adapter 0..{num_adapters - 1}")
    order = torch.sort(index, stable=True).indices
    counts = torch.bincount(index, minlength=num_adapters)
    return order, AdapterRows(tuple(int(c) for c in counts))


class ReadsAdapterRows:
    """A layer that reads the batch's adapter rows (`routed` sets them; None outside its scope)."""

    adapter_rows: AdapterRows | None = None


def route(model: nn.Module, rows: AdapterRows | None) -> None:
    """Set the rows every multi-adapter linear of `model` reads (None: none, and a forward then raises).

    A training step routes before its forward and unroutes after its backward (`routed` does both)."""
    for module in model.modules():
        if isinstance(module, ReadsAdapterRows):
            module.adapter_rows = rows


@contextlib.contextmanager
def routed(model: nn.Module, rows: AdapterRows) -> Iterator[None]:
    """Every multi-adapter linear of `model` trains each row with its own adapter inside this scope.

    Run the forward and the backward inside it (activation checkpointing recomputes in the backward)."""
    route(model, rows)
    try:
        yield
    finally:
        route(model, None)

"""Which HF row each torchtitan row comes from, found by running the family's state-dict adapter on probes.

An adapter's `from_hf` may reorder rows (torchtitan's Llama permutes q/k rows per head for its interleaved
RoPE); a rank reading a slice must know which HF rows make its rows. Rather than restate each family's
permutation, `from_hf` is run once on index probes of every weight of layer 0 (and the weights outside the
layers): a probe whose rows hold their own index comes out holding, per torchtitan row, its HF row. The
probes are expanded (stride 0), so an unpermuted weight costs no memory; a permuted one one int32 copy.
A mapping that is not a pure row permutation (columns moved, shapes changed, e.g. MoE experts stacked) is
refused: a slice cannot be read for it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

import torch


def abstract_name(name: str) -> str:
    """A weight name with its layer index as `{}` (`layers.3.attention.qkv_linear.wq.weight` -> `layers.{}...`)."""
    return re.sub(r"\d+", "{}", name, count=1)


def _probe(shape: tuple[int, ...], dim: int) -> torch.Tensor:
    """A tensor of `shape` holding, everywhere, its index along `dim` (expanded: no memory)."""
    index = torch.arange(shape[dim], dtype=torch.int32)
    return index.view([-1 if d == dim else 1 for d in range(len(shape))]).expand(shape)


def _representatives(hf_shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Layer 0's weights and those outside the layers: every abstract name once (layers share a mapping)."""
    return {n: s for n, s in hf_shapes.items() if re.search(r"\d+", n) is None or ".layers.0." in n}


def _reordered_rows(rows: torch.Tensor, cols: torch.Tensor | None) -> torch.Tensor | None:
    """The HF row of each row, from the mapped row and column probes; None: more than a row reordering."""
    if rows.dim() == 1:
        return rows
    # stride 0: still the expanded probe, constant by construction (an embedding costs no comparison)
    rows_whole = rows.dim() == 2 and (rows.stride(1) == 0 or torch.equal(rows, rows[:, :1].expand_as(rows)))
    cols_kept = cols is not None and cols.shape == rows.shape and (
        cols.stride(0) == 0 or torch.equal(cols, cols[:1].expand_as(cols))) and torch.equal(
        cols[0], torch.arange(cols.shape[1], dtype=cols.dtype))
    return rows[:, 0] if rows_whole and cols_kept else None


def row_maps(from_hf: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
             hf_shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor | None]:
    """Abstract torchtitan weight name -> the HF row of each of its rows (None: row i is HF row i).

    `from_hf` is the adapter's mapping of an HF state dict (unknown names filtered out beforehand)."""
    shapes = _representatives(hf_shapes)
    rows = from_hf({n: _probe(s, 0) for n, s in shapes.items()})
    cols = from_hf({n: _probe(s, 1) for n, s in shapes.items() if len(s) > 1})
    out: dict[str, torch.Tensor | None] = {}
    for name, probe in rows.items():
        first = _reordered_rows(probe, cols.get(name))
        if first is None:
            raise ValueError(f"the state-dict adapter maps {name} by more than a reordering of its rows; "
                             "the sliced load cannot read it: give the family an adapter whose from_hf only "
                             "renames and reorders rows")
        identity = torch.equal(first, torch.arange(first.numel(), dtype=first.dtype))
        out[abstract_name(name)] = None if identity else first.clone()
    return out

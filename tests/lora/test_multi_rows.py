"""A batch's rows grouped by adapter: the order, the segments, and the scope the linears read them in."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from titan_lora.lora.multi_rows import AdapterRows, ReadsAdapterRows, group_rows, routed


def test_group_rows_sorts_stably_and_counts_every_adapter() -> None:
    order, rows = group_rows(torch.tensor([[2, 0], [2, 0], [0, 0]]).flatten(), 4)
    assert order.tolist() == [1, 3, 4, 5, 0, 2], "each adapter's rows keep the batch's order"
    assert rows == AdapterRows((4, 0, 2, 0)), "an adapter with no rows still has its (empty) segment"
    assert rows.offsets == (0, 4, 4, 6, 6) and rows.bounds(2) == (4, 6)
    many = torch.randint(0, 4, (5000,), generator=torch.Generator().manual_seed(0))
    order, rows = group_rows(many, 4)
    for k in range(4):  # a batch's tokens, labels and masks are all reordered by it: one order for all
        start, end = rows.bounds(k)
        assert order[start:end].tolist() == (many == k).nonzero().flatten().tolist(), k


def test_group_rows_refuses_an_adapter_index_out_of_range() -> None:
    with pytest.raises(ValueError, match="row adapter index 3 is out of range for 3 adapters"):
        group_rows([0, 3, 1], 3)
    with pytest.raises(ValueError, match="row adapter index -1 is out of range"):
        group_rows([0, -1], 3)
    with pytest.raises(ValueError, match="negative count"):
        AdapterRows((2, -1))


class _Reader(ReadsAdapterRows, nn.Module):
    pass


def test_routed_sets_the_rows_on_every_reader_for_its_scope_only() -> None:
    model = nn.Sequential(_Reader(), nn.Sequential(_Reader()), nn.Linear(2, 2))
    rows = AdapterRows((1, 2))
    with pytest.raises(KeyError):
        with routed(model, rows):
            assert model[0].adapter_rows is rows and model[1][0].adapter_rows is rows
            raise KeyError("a failing forward")
    assert model[0].adapter_rows is None and model[1][0].adapter_rows is None, "cleared even on an error"

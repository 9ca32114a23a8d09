"""The emitter protocol's helpers: payload sizes, base items, names."""

from __future__ import annotations

import pytest
import torch

from titan_lora.clients.base import AdapterPayload, base_items
from titan_lora.transfer.errors import check_name


def test_payload_sizes() -> None:
    p = AdapterPayload("p-v1", 1, {"a": torch.zeros(3, 2), "b": torch.zeros(5, dtype=torch.bfloat16)}, {})
    assert (p.num_tensors, p.nbytes) == (2, 34)


def test_base_items_takes_a_mapping_or_pairs_lazily() -> None:
    t = torch.ones(1)
    assert list(base_items({"x": t})) == [("x", t)]
    pairs = iter([("y", t)])
    assert base_items(pairs) is pairs


def test_a_name_with_path_characters_is_refused_with_the_rule() -> None:
    with pytest.raises(ValueError) as err:
        check_name("../x", "segment name")
    assert str(err.value) == ("segment name '../x' is not a bare name: use letters, digits, '.', '_' and '-', "
                              "not starting with '.'")
    with pytest.raises(ValueError, match="^adapter name 7 is not"):
        check_name(7)

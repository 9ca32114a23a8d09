"""Shared buffers: a tensor from `shared_tensor` is found again from any view, and an engine-side
mapping of its descriptor (with the bucket's byte offset) sees the same bytes."""

from __future__ import annotations

import pytest
import torch

from titan_lora.emitters.transport import BufferCache, home_of, shared_tensor


def test_a_view_of_a_shared_tensor_is_sent_in_place_from_its_offset() -> None:
    full = shared_tensor(1000, torch.float32, torch.device("cpu"))
    assert torch.count_nonzero(full) == 0, "shared tensors start zeroed"
    view = full[100:164]
    view.copy_(torch.arange(64, dtype=torch.float32))
    buf, offset = home_of(view)
    assert offset == 400, "offset in bytes from the buffer's start"

    engine_side = BufferCache()  # holds the mapping open, as the engine does
    mapped = engine_side.get(buf.describe(offset))  # a separate mapping of the same memory
    assert mapped.data_ptr() != view.data_ptr()
    assert torch.equal(mapped[: 64 * 4].view(torch.float32), view)
    view.mul_(2)  # the trainer writes the next version into the same buffer
    assert torch.equal(mapped[: 64 * 4].view(torch.float32), view)


def test_plain_tensors_have_no_home() -> None:
    assert home_of(torch.zeros(8)) is None


def test_an_engine_that_cannot_see_the_segment_refuses_instead_of_reading_zeros() -> None:
    desc = {"kind": "shm", "name": "psm_titan_lora_no_such_segment", "size": 4096, "offset": 0}
    with pytest.raises(FileNotFoundError, match="not visible here"):
        BufferCache().get(desc)

"""The engine's one-pass host copy-out gives the source's bytes and `bucket_checksum`'s digest of them, for
sizes around the chunk and block boundaries and both threads' halves; small buckets keep the two passes."""

from __future__ import annotations

import pytest
import torch

from titan_lora.transfer.buckets import bucket_checksum
from titan_lora.transfer.host_passes import BLOCK_CHUNKS, CHUNK_BYTES, ONE_PASS_MIN_BYTES, host_copy_with_checksum

SIZES = [8, CHUNK_BYTES - 8, CHUNK_BYTES, CHUNK_BYTES + 72, 3 * BLOCK_CHUNKS * CHUNK_BYTES + 5 * CHUNK_BYTES + 16]


@pytest.mark.parametrize("nbytes", SIZES)
def test_copy_with_checksum_is_a_copy_and_bucket_checksum(nbytes: int) -> None:
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))
    dst = torch.zeros_like(src)
    digest = host_copy_with_checksum(dst, src, min_bytes=0)
    assert torch.equal(dst, src)
    assert digest == bucket_checksum(src)
    src[nbytes // 2] ^= 1  # one flipped bit anywhere changes it
    assert host_copy_with_checksum(dst, src, min_bytes=0) != digest


def test_declines_what_it_cannot_copy_in_one_pass() -> None:
    big = torch.zeros(ONE_PASS_MIN_BYTES, dtype=torch.uint8)
    assert host_copy_with_checksum(torch.empty_like(big), big) == bucket_checksum(big)
    assert host_copy_with_checksum(big[: ONE_PASS_MIN_BYTES - 64].clone(), big[64:]) is None  # small: two passes
    unaligned = torch.zeros(72, dtype=torch.uint8)[1:65]
    assert host_copy_with_checksum(torch.zeros(64, dtype=torch.uint8), unaligned, min_bytes=0) is None
    assert host_copy_with_checksum(torch.zeros(63, dtype=torch.uint8), big[:64], min_bytes=0) is None

"""A digest of a tensor that shards can compute apart: the trainer's ranks over their own shards, the engine
over its whole tensors, and the two agree bit for bit when the values do.

The digest is a sum over elements, modulo a prime, of each element's bits times a pseudo-random weight
drawn from the element's flat index in the tensor's HF layout and the tensor's name. A sum splits over any
partition of the elements, so each rank digests its shard (given the HF indices of its elements) and an
all-reduce adds the parts: no weight byte moves. Two lanes with independent weights make a 62-bit digest;
any single changed element changes both lanes (every weight is invertible modulo the prime), and a moved
row or a permutation changes them unless the moved values are equal. All arithmetic is int64 without
overflow: indices below 2^32 elements, weights and residues below 2^31, bits below 2^32.
"""

from __future__ import annotations

import hashlib

import torch

PRIME = 2**31 - 1
"""The modulus of both lanes (a Mersenne prime: every weight in [1, PRIME) is invertible)."""
_LANES = ((1_103_515_245, 12_345), (48_271, 2_147_483_629))  # (multiplier, offset) of each lane's index map
_BITS = {torch.float32: (torch.int32, 0xFFFFFFFF), torch.bfloat16: (torch.int16, 0xFFFF),
         torch.float16: (torch.int16, 0xFFFF)}
MAX_ELEMENTS = 2**32
"""The most elements one tensor may have (the index map's products stay below 2^63)."""


def _salt(name: str, lane: int) -> int:
    """A per-tensor, per-lane offset, so equal tensors under different names digest differently."""
    return int.from_bytes(hashlib.blake2b(f"{lane}:{name}".encode(), digest_size=4).digest(), "little") % PRIME


def element_bits(values: torch.Tensor) -> torch.Tensor:
    """The IEEE bits of each element as a non-negative int64 (bf16, fp16, fp32)."""
    if values.dtype not in _BITS:
        raise ValueError(f"cannot digest a {values.dtype} tensor; the base is bf16, fp16 or fp32")
    view, mask = _BITS[values.dtype]
    return values.contiguous().view(view).to(torch.int64) & mask


def partial_digest(name: str, values: torch.Tensor, flat_index: torch.Tensor) -> torch.Tensor:
    """The two lanes' sums (int64 [2], each below PRIME) over `values`, whose elements sit at `flat_index`
    (same shape, int64) in the full tensor's HF layout. Parts of one tensor add up (then `fold`)."""
    if values.shape != flat_index.shape:
        raise ValueError(f"{name}: values {tuple(values.shape)} and indices {tuple(flat_index.shape)} differ")
    bits = element_bits(values)
    lanes = []
    for lane, (mult, offset) in enumerate(_LANES):
        x = (flat_index * mult + offset + _salt(name, lane)) % PRIME
        weight = (x * x) % PRIME + 1  # squared: not a linear function of the index; never 0
        weight = torch.where(weight == PRIME, torch.ones_like(weight), weight)
        lanes.append(((weight * bits) % PRIME).sum() % PRIME)
    return torch.stack(lanes)


def fold(parts: torch.Tensor) -> str:
    """The digest (16 hex digits) of a tensor from its summed lanes (`partial_digest`s added up)."""
    lo, hi = (int(v) % PRIME for v in parts.tolist())
    return f"{lo * PRIME + hi:016x}"


CHUNK_ELEMENTS = 1 << 24
"""Elements digested at once: the int64 temporaries stay a few hundred MB on any tensor."""


def rows_digest(name: str, values: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, width: int) -> torch.Tensor:
    """`partial_digest` of a block of a matrix: `values` [r, c] holds the full tensor's rows `rows` [r] and
    columns `cols` [c] (int64), the full tensor being `width` columns wide; taken in row chunks."""
    per_chunk = max(1, CHUNK_ELEMENTS // max(values.shape[1], 1))
    total = torch.zeros(2, dtype=torch.int64, device=values.device)
    for start in range(0, values.shape[0], per_chunk):
        block_rows = rows[start : start + per_chunk]
        flat = block_rows[:, None] * width + cols[None, :]
        total += partial_digest(name, values[start : start + per_chunk], flat)
    return total % PRIME


def as_matrix(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as [rows, columns]: a vector is one column, higher ranks fold into the columns."""
    return tensor.reshape(tensor.shape[0], -1) if tensor.dim() else tensor.reshape(1, 1)


def tensor_digest(name: str, tensor: torch.Tensor) -> str:
    """The digest of a whole tensor in its own (HF) layout: what the engine computes."""
    if tensor.numel() >= MAX_ELEMENTS:
        raise ValueError(f"{name} has {tensor.numel()} elements; digests take fewer than {MAX_ELEMENTS}")
    matrix = as_matrix(tensor)
    rows = torch.arange(matrix.shape[0], dtype=torch.int64, device=tensor.device)
    cols = torch.arange(matrix.shape[1], dtype=torch.int64, device=tensor.device)
    return fold(rows_digest(name, matrix, rows, cols, matrix.shape[1]))

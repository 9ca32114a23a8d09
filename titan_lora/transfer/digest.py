"""A digest of a tensor that shards can compute apart: the trainer's ranks over their own shards, the engine
over its whole tensors, and the two agree bit for bit when the values do.

A tensor is seen as a matrix (`as_matrix`) in its HF layout. Its digest has two lanes, each modulo its own
prime p: sum over rows r of w(r) * (sum over columns c of v(c) * bits(r, c)), where bits are the element's
IEEE bits, w a pseudo-random weight in [1, p) and v one in [1, 2^15), drawn from the row and column numbers and the tensor's
name. A sum splits over any block of rows and columns, so each rank digests its shard (given the global row
and column numbers of its block) and an all-reduce adds the parts: no weight byte moves. A single changed
element changes both lanes (its bits differ by less than p1 * p2, and every weight is invertible), a moved
row or column changes them unless the moved values are equal. Every product stays below 2^63 in int64.
"""

from __future__ import annotations

import hashlib

import torch

PRIMES = (2**31 - 1, 2**31 - 19)
"""The modulus of each lane."""
_ROW, _COL = (1_103_515_245, 12_345), (48_271, 2_147_483_629)  # (multiplier, offset) of the weight maps
_BITS = {torch.float32: (torch.int32, 0xFFFFFFFF), torch.bfloat16: (torch.int16, 0xFFFF),
         torch.float16: (torch.int16, 0xFFFF)}
MAX_INDEX = 2**31
"""Rows and columns are numbered below this (the weight maps' products stay below 2^63)."""
COLUMN_WEIGHT_BOUND = 2**15 - 1
"""Column weights are at most this, so a row's sum over COLUMNS_PER_SUM columns of 32-bit values stays
below 2^63 without a modulo per element (the digest's cost is a multiply and a sum per element)."""
COLUMNS_PER_SUM = 2**16
CHUNK_ELEMENTS = 1 << 24
"""Elements digested at once: the int64 temporaries stay a few hundred MB on any tensor."""


def _salt(name: str, lane: int) -> int:
    """A per-tensor, per-lane offset, so equal tensors under different names digest differently."""
    return int.from_bytes(hashlib.blake2b(f"{lane}:{name}".encode(), digest_size=4).digest(), "little")


def _weights(index: torch.Tensor, mult_offset: tuple[int, int], salt: int, prime: int, below: int) -> torch.Tensor:
    """A weight in [1, below] (below < prime) for each index: squared, so not a linear function of it."""
    mult, offset = mult_offset
    x = (index * mult + offset + salt) % prime
    return (x * x) % prime % below + 1


def element_bits(values: torch.Tensor) -> torch.Tensor:
    """The IEEE bits of each element as a non-negative int64 (bf16, fp16, fp32)."""
    if values.dtype not in _BITS:
        raise ValueError(f"cannot digest a {values.dtype} tensor; the base is bf16, fp16 or fp32")
    view, mask = _BITS[values.dtype]
    return values.contiguous().view(view).to(torch.int64) & mask


def as_matrix(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as [rows, columns]: a vector is one column, higher ranks fold into the columns."""
    return tensor.reshape(tensor.shape[0], -1) if tensor.dim() else tensor.reshape(1, 1)


def block_digest(name: str, values: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """The two lanes (int64 [2]) of the block `values` [r, c] of matrix `name`, whose rows and columns are
    the matrix's `rows` [r] and `cols` [c] (int64). The lanes of a matrix's blocks add up (`fold`)."""
    if values.shape != (rows.numel(), cols.numel()):
        raise ValueError(f"{name}: a block of {tuple(values.shape)} with {rows.numel()} rows and "
                         f"{cols.numel()} columns")
    lanes = torch.zeros(2, dtype=torch.int64, device=values.device)
    per_chunk = max(1, CHUNK_ELEMENTS // max(values.shape[1], 1))
    for start in range(0, values.shape[0], per_chunk):
        bits = element_bits(values[start : start + per_chunk])
        for lane, prime in enumerate(PRIMES):
            salt = _salt(name, lane)
            row_sums = torch.zeros(bits.shape[0], dtype=torch.int64, device=values.device)
            for c in range(0, bits.shape[1], COLUMNS_PER_SUM):  # column weights < 2^15, bits < 2^32: no overflow
                col_weight = _weights(cols[c : c + COLUMNS_PER_SUM], _COL, salt, prime, COLUMN_WEIGHT_BOUND)
                row_sums += (bits[:, c : c + COLUMNS_PER_SUM] * col_weight).sum(dim=1) % prime
            row_weight = _weights(rows[start : start + per_chunk], _ROW, salt, prime, prime - 1)
            lanes[lane] += ((row_sums % prime) * row_weight % prime).sum() % prime
    return lanes % torch.tensor(PRIMES, device=values.device)


def fold(lanes: torch.Tensor) -> str:
    """The digest (16 hex digits) of a tensor from its blocks' lanes added up."""
    lo, hi = (int(v) % p for v, p in zip(lanes.tolist(), PRIMES))
    return f"{lo:08x}{hi:08x}"


def tensor_digest(name: str, tensor: torch.Tensor) -> str:
    """The digest of a whole tensor in its own (HF) layout: what the engine computes."""
    matrix = as_matrix(tensor)
    if max(matrix.shape) >= MAX_INDEX:
        raise ValueError(f"{name} has {tuple(matrix.shape)} rows and columns; digests take fewer than {MAX_INDEX}")
    rows = torch.arange(matrix.shape[0], dtype=torch.int64, device=tensor.device)
    cols = torch.arange(matrix.shape[1], dtype=torch.int64, device=tensor.device)
    return fold(block_digest(name, matrix, rows, cols))

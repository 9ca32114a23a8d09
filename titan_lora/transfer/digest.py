"""A digest of a tensor that shards can compute apart: the trainer's ranks over their own shards, the engine
over its whole tensors, and the two agree bit for bit when the values do.

A tensor is seen as a matrix (`as_matrix`) in its HF layout. Its digest has two lanes, each modulo its own
prime p: sum over rows r of w(r) * (sum over columns c of v(c) * bits(r, c)), where bits are the element's
IEEE bits, w a pseudo-random weight in [1, p) drawn from the row number and the tensor's name, and v a weight
in [1, 2^15]. A column's two weights (one per lane) are the two 15-bit halves of a keyed, nonlinear
permutation of the column numbers below 2^30 (`column_weights`): no two columns of a matrix share both, which
independent draws from 2^15 values would not ensure (Llama-3-70B's 28672-wide `down_proj` had such pairs).
A sum splits over any block of rows and columns, so each rank digests its shard (given the global row
and column numbers of its block) and an all-reduce adds the parts: no weight byte moves. A single changed
element changes a lane (its bits differ by less than p1 * p2, and every weight is nonzero modulo p); two
swapped rows or columns change the lane whose weights differ for them unless the swapped values are equal,
or the change is a multiple of that lane's prime. Every product stays below 2^63 in int64.
"""

from __future__ import annotations

import hashlib

import torch

PRIMES = (2**31 - 1, 2**31 - 19)
"""The modulus of each lane."""
_ROW = (1_103_515_245, 12_345)  # (multiplier, offset) of the row weight map
_COLUMN_MIX = ((0x2C1B3C6D, 16), (0x297A2D39, 13))  # (odd multiplier, xor shift) rounds of the column permutation
_BITS = {torch.float32: (torch.int32, 0xFFFFFFFF), torch.bfloat16: (torch.int16, 0xFFFF),
         torch.float16: (torch.int16, 0xFFFF)}
MAX_INDEX = 2**31
"""Rows are numbered below this (the row weight map's products stay below 2^63)."""
COLUMN_BITS = 15
COLUMN_WEIGHT_BOUND = 2**COLUMN_BITS
"""Column weights are at most this, so a row's sum over COLUMNS_PER_SUM columns of 32-bit values stays
below 2^63 without a modulo per element (the digest's cost is a multiply and a sum per element)."""
MAX_COLUMNS = 2 ** (2 * COLUMN_BITS)
"""Columns are numbered below this: the domain of the permutation whose halves are their weights."""
COLUMNS_PER_SUM = 2**16
CHUNK_ELEMENTS = 1 << 24
"""Elements digested at once: the int64 temporaries stay a few hundred MB on any tensor."""


def _salt(name: str, lane: int) -> int:
    """A per-tensor, per-lane offset, so equal tensors under different names digest differently."""
    return int.from_bytes(hashlib.blake2b(f"{lane}:{name}".encode(), digest_size=4).digest(), "little")


def row_weights(name: str, rows: torch.Tensor, lane: int) -> torch.Tensor:
    """Each row's weight in `lane`, in [1, p): squared, so not a linear function of the row number."""
    prime, (mult, offset) = PRIMES[lane], _ROW
    x = (rows * mult + offset + _salt(name, lane)) % prime
    return (x * x) % prime % (prime - 1) + 1


def column_weights(name: str, cols: torch.Tensor) -> torch.Tensor:
    """Each column's weight in either lane (int64 [2, len(cols)]), in [1, 2^15]: the high and low halves of
    a keyed permutation of the column numbers (below MAX_COLUMNS), so no two columns share both weights.
    Adding the salt, multiplying by an odd number and x ^= x >> s are each one-to-one modulo 2^30."""
    mask = MAX_COLUMNS - 1
    x = (cols + _salt(name, 0)) & mask
    for mult, shift in _COLUMN_MIX:
        x = (x * mult) & mask
        x = x ^ (x >> shift)
    return torch.stack([(x >> COLUMN_BITS) + 1, (x & (COLUMN_WEIGHT_BOUND - 1)) + 1])


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
            row_sums = torch.zeros(bits.shape[0], dtype=torch.int64, device=values.device)
            for c in range(0, bits.shape[1], COLUMNS_PER_SUM):  # column weights <= 2^15, bits < 2^32: no overflow
                col_weight = column_weights(name, cols[c : c + COLUMNS_PER_SUM])[lane]
                row_sums += (bits[:, c : c + COLUMNS_PER_SUM] * col_weight).sum(dim=1) % prime
            row_weight = row_weights(name, rows[start : start + per_chunk], lane)
            lanes[lane] += ((row_sums % prime) * row_weight % prime).sum() % prime
    return lanes % torch.tensor(PRIMES, device=values.device)


def fold(lanes: torch.Tensor) -> str:
    """The digest (16 hex digits) of a tensor from its blocks' lanes added up."""
    lo, hi = (int(v) % p for v, p in zip(lanes.tolist(), PRIMES))
    return f"{lo:08x}{hi:08x}"


def tensor_digest(name: str, tensor: torch.Tensor) -> str:
    """The digest of a whole tensor in its own (HF) layout: what the engine computes."""
    matrix = as_matrix(tensor)
    if matrix.shape[0] >= MAX_INDEX or matrix.shape[1] >= MAX_COLUMNS:
        raise ValueError(f"{name} has {tuple(matrix.shape)} rows and columns; digests take fewer than "
                         f"{MAX_INDEX} rows and {MAX_COLUMNS} columns")
    rows = torch.arange(matrix.shape[0], dtype=torch.int64, device=tensor.device)
    cols = torch.arange(matrix.shape[1], dtype=torch.int64, device=tensor.device)
    return fold(block_digest(name, matrix, rows, cols))

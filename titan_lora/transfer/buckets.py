"""The bucket wire format, shared by the trainer side (pack) and the engine side (copy_out).

A bucket is a flat byte buffer holding whole tensors back to back, each aligned to 64 bytes, plus a
JSON-able header of names, shapes, dtypes and offsets. No pickle crosses from one side to the other.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import math
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch

from titan_lora.transfer.cuda_graphs import GraphedReads

ALIGN = 64
CHECKSUM_CHUNK_WORDS = 1024  # 8 KiB chunks: a misplaced or misread chunk changes its own sum
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16)}


@dataclasses.dataclass(frozen=True)
class Entry:
    """Where one tensor lies in its bucket."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int

    def to_json(self) -> dict:
        """The header form of this entry."""
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype,
                "offset": self.offset, "nbytes": self.nbytes}

    @staticmethod
    def from_json(row: Mapping) -> Entry:
        """Parse one header row, rejecting dtypes we do not send."""
        if row["dtype"] not in _DTYPES:
            raise ValueError(f"unsupported dtype {row['dtype']!r} in bucket header")
        return Entry(str(row["name"]), tuple(int(d) for d in row["shape"]), row["dtype"], int(row["offset"]),
                     int(row["nbytes"]))


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def entry_for(name: str, t: torch.Tensor, offset: int) -> Entry:
    """The entry of tensor `t` placed `offset` bytes into its bucket; refuses dtypes we do not send."""
    dtype = str(t.dtype).removeprefix("torch.")
    if dtype not in _DTYPES:
        raise ValueError(f"{name}: dtype {t.dtype} cannot be sent; use float32, bfloat16 or float16")
    return Entry(name, tuple(t.shape), dtype, offset, t.numel() * t.element_size())


def next_offset(entry: Entry) -> int:
    """Where the tensor after `entry` starts in the same bucket."""
    return _aligned(entry.offset + entry.nbytes)


def stream_buckets(
    items: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[tuple[list[Entry], dict[str, torch.Tensor], bool]]:
    """Group (name, tensor) pairs, in order, into buckets of at most `bucket_bytes` (a larger tensor gets
    its own), consuming `items` only as far as the bucket being filled needs; the flag marks the last."""
    entries: list[Entry] = []
    tensors: dict[str, torch.Tensor] = {}
    for name, t in items:
        used = next_offset(entries[-1]) if entries else 0
        if entries and used + t.numel() * t.element_size() > bucket_bytes:
            yield entries, tensors, False  # a tensor follows: not the last
            entries, tensors, used = [], {}, 0
        entries.append(entry_for(name, t, used))
        tensors[name] = t
    if entries:
        yield entries, tensors, True


def plan_buckets(tensors: Mapping[str, torch.Tensor], bucket_bytes: int) -> list[list[Entry]]:
    """Split tensors, in order, into buckets of at most `bucket_bytes` (a larger tensor gets its own)."""
    return [entries for entries, _, _ in stream_buckets(tensors.items(), bucket_bytes)]


def bucket_size(entries: Sequence[Entry]) -> int:
    """Bytes a bucket occupies."""
    return max((e.offset + e.nbytes for e in entries), default=0)


def one_run(entries: Sequence[Entry], tensors: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    """The bucket's bytes as one view when its tensors already lie in one storage at the bucket's
    offsets (the gatherer's output does), else None."""
    first = tensors[entries[0].name]
    storage = first.untyped_storage()
    base = first.data_ptr()
    for e in entries:
        t = tensors[e.name]
        if not t.is_contiguous() or t.untyped_storage().data_ptr() != storage.data_ptr() \
                or t.data_ptr() - base != e.offset:
            return None
    start = base - storage.data_ptr()
    run = torch.empty(0, dtype=torch.uint8, device=first.device)
    return run.set_(storage, start, (bucket_size(entries),))


def pack(buffer: torch.Tensor, entries: Sequence[Entry], tensors: Mapping[str, torch.Tensor],
         run: torch.Tensor | None = None) -> None:
    """Copy the bucket's tensors into `buffer` (a uint8 tensor on the tensors' device); `run` is
    `one_run(entries, tensors)` when the caller already has it."""
    run = one_run(entries, tensors) if run is None else run
    if run is not None:  # one copy for the whole bucket
        buffer[: run.numel()].copy_(run, non_blocking=True)
        return
    for e in entries:
        pack_one(buffer, e, tensors[e.name])


def pack_one(buffer: torch.Tensor, entry: Entry, tensor: torch.Tensor) -> None:
    """Copy one tensor into its place in `buffer`."""
    src = tensor.detach().contiguous().view(-1).view(torch.uint8)
    buffer[entry.offset : entry.offset + entry.nbytes].copy_(src, non_blocking=True)


def tensor_views(storage: torch.Tensor, entries: Sequence[Entry]) -> dict[str, torch.Tensor]:
    """Each entry's tensor as a view of `storage` (uint8, laid out as the bucket)."""
    return {
        e.name: storage[e.offset : e.offset + e.nbytes].view(_DTYPES[e.dtype]).view(e.shape) for e in entries
    }


def copy_out(buffer: torch.Tensor, entries: Sequence[Entry]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(storage the receiver owns, each tensor as a view of it): one copy of the bucket out of `buffer`."""
    owned = buffer[: bucket_size(entries)].clone()
    if owned.is_cuda:  # the copy must be done before the ack lets the trainer reuse the buffer
        torch.cuda.current_stream(owned.device).synchronize()
    return owned, tensor_views(owned, entries)


def bucket_checksum(data: torch.Tensor, *, graphed: bool = True) -> str:
    """A cheap, position-sensitive digest of a uint8 tensor, identical on CPU and GPU.

    Sums of 64-bit words per 8 KiB chunk, then two sums over the chunk sums: plain, and weighted by an
    odd multiplier per chunk position (integer arithmetic wraps mod 2**64, so the order of a reduction
    does not matter and both devices agree). The digest is two words, so a GPU bucket costs two
    reductions and a 16-byte host read (hashing every chunk sum on the host cost 8x a device copy). On
    GPU those kernels replay from a CUDA graph per buffer (address and size): launching them one by one
    cost more host time than they run. `graphed` False: a buffer seen once, whose capture would cost more.
    """
    data = data.reshape(-1)
    n = data.numel()
    if not n:
        return f"w64:{0:032x}:0"
    if data.is_cuda and graphed:
        plain, weighted = _GRAPHED_DIGESTS.read((data.device, data.data_ptr(), n), data.device,
                                                lambda: checksum_words(data))
    else:
        plain, weighted = checksum_words(data).tolist()
    return format_checksum(plain, weighted, n)


def format_checksum(plain: int, weighted: int, nbytes: int) -> str:
    """`bucket_checksum`'s text from the two words `checksum_words` gave for `nbytes` bytes."""
    return f"w64:{plain % 2**64:016x}{weighted % 2**64:016x}:{nbytes}"


def checksum_words(data: torch.Tensor, chunk_sums: torch.Tensor | None = None) -> torch.Tensor:
    """The two digest words of a flat, non-empty uint8 tensor, on its device: for device work that reads
    them back together with other values, in one host read (`format_checksum` makes the text).
    `chunk_sums`: the word sums of its whole chunks, when the caller already took them (a fused copy)."""
    if data.storage_offset() % 8:  # a 64-bit view needs 8-byte alignment (buckets are 64-aligned)
        data = data.clone()
    chunk = CHECKSUM_CHUNK_WORDS * 8
    full = data.numel() // chunk
    parts = []
    if full:
        parts.append(data[: full * chunk].view(torch.int64).view(full, CHECKSUM_CHUNK_WORDS).sum(1)
                     if chunk_sums is None else chunk_sums)
    rest = data[full * chunk :]
    if rest.numel():
        words = rest.numel() // 8
        parts.append(rest[: words * 8].view(torch.int64).sum().view(1))
        parts.append(rest[words * 8 :].to(torch.int64).sum().view(1))
    sums = torch.cat(parts) if len(parts) > 1 else parts[0]
    weights = _chunk_weights(sums.numel(), sums.device)
    return torch.stack([sums.sum(), (sums * weights).sum()])


_GRAPHED_DIGESTS = GraphedReads()


_GOLDEN = 0x9E3779B97F4A7C15 - 2**64  # 2**64 / golden ratio, as a signed 64-bit int: spreads the weights


# Per device, the weights table; every table ever made stays alive, because a captured graph reads its
# weights by address (a freed and reused table would change every digest it replays). Tables double in
# size, so all of them together hold at most four times the largest bucket's weights.
_WEIGHTS: dict[torch.device, torch.Tensor] = {}
_KEPT: list[torch.Tensor] = []
_WEIGHTS_LOCK = threading.Lock()


def _chunk_weights(count: int, device: torch.device) -> torch.Tensor:
    """The odd multiplier of each chunk sum: (position + 1) * GOLDEN mod 2**64, lowest bit set."""
    with _WEIGHTS_LOCK:
        table = _WEIGHTS.get(device)
        if table is None or table.numel() < count:
            size = 1 << max(count - 1, 1).bit_length()
            table = _WEIGHTS[device] = (torch.arange(1, size + 1, dtype=torch.int64, device=device) * _GOLDEN) | 1
            _KEPT.append(table)
    return table[:count]


class UnknownLayout(KeyError):
    """The receiver has not seen this bucket layout yet (e.g. it restarted): send the header."""


class LayoutCache:
    """Receiver side: bucket headers by layout id, so a repeated layout travels as its id alone.

    A header is kept only under the id it hashes to (`layout_id`), and the first one kept for an id
    stays: a request cannot make later buckets of that layout read another one's offsets. At most
    `max_entries` tensor entries are kept, the least recently used layouts dropped first (a dropped
    layout is answered as unknown, and the trainer sends its header again)."""

    def __init__(self, max_entries: int = 1 << 18) -> None:
        self.max_entries = max_entries
        self._layouts: collections.OrderedDict[str, list[Entry]] = collections.OrderedDict()
        self._entries = 0
        self._lock = threading.Lock()  # the receiver serves buckets from several threads

    def resolve(self, layout: str, header: list[dict] | None) -> list[Entry]:
        """The entries of `layout`; a `header` given is checked (`parse_header`), and kept if the layout
        is new."""
        entries = None if header is None else parse_header(layout, header, self.max_entries)
        with self._lock:
            if entries is None:
                known = self._layouts.get(layout)
                if known is None:
                    raise UnknownLayout(f"unknown bucket layout {layout}")
                self._layouts.move_to_end(layout)
                return known
            if layout not in self._layouts:  # another thread may have kept it meanwhile: the first stays
                self._layouts[layout] = entries
                self._entries += len(entries)
                while self._entries > self.max_entries:
                    self._entries -= len(self._layouts.popitem(last=False)[1])
            self._layouts.move_to_end(layout)
            return self._layouts[layout]


def parse_header(layout: str, header: list[dict], max_entries: int) -> list[Entry]:
    """The entries of `header`, once it is shown to be the layout `layout` names: its id, and byte counts
    and offsets that fit its shapes and dtypes (a ValueError says what does not)."""
    if not isinstance(header, list) or len(header) > max_entries:
        raise ValueError(f"a bucket header must be a list of at most {max_entries} entries")
    try:
        entries = [Entry.from_json(row) for row in header]
    except (KeyError, TypeError) as err:
        raise ValueError(f"a bucket header entry is malformed ({type(err).__name__}: {err}); each names "
                         "name, shape, dtype, offset and nbytes") from None
    for e in entries:
        if e.offset < 0 or e.nbytes != math.prod(e.shape) * _DTYPES[e.dtype].itemsize or min(e.shape, default=0) < 0:
            raise ValueError(f"bucket header entry {e.name!r}: {e.nbytes} bytes at offset {e.offset} do not fit "
                             f"shape {list(e.shape)} of {e.dtype}")
    if layout_id(entries) != layout:
        raise ValueError(f"the bucket header is layout {layout_id(entries)}, the request names {layout}: send "
                         "the header of the layout the request names")
    return entries


def layout_id(entries: Sequence[Entry]) -> str:
    """A stable id of a bucket layout (names, shapes, dtypes, offsets)."""
    text = "|".join(f"{e.name}:{e.shape}:{e.dtype}:{e.offset}" for e in entries)
    return hashlib.sha1(text.encode()).hexdigest()[:16]

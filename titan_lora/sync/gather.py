"""Gather every adapter shard onto rank 0 in one collective.

A per-parameter `full_tensor()` loop costs one collective per tensor (448 for an 8B model with LoRA
on all linears), and a naive coalesced gather spends its time on `torch.cat`, a size exchange and host
syncs. Here all shapes and shard layouts are fixed at construction, so each sync is:
one copy of the local shards into a preallocated send buffer, one `dist.gather` into a preallocated
receive buffer, and a scatter of every element to its place in the full tensors.

The scatter index is built once, from each param's own DTensor placements (a sharded arange), so it
holds for any mix of FSDP and TP placements, uneven shards included. On GPU the scatter is one
`index_copy_` kernel, over 8-byte words wherever the index moves whole aligned words (every run a
multiple of 4 bf16 elements: rows of r >= 4 columns, even shards): a quarter of the index to read
(an 8B adapter's element index alone is 336 MB, four times its bytes). On CPU an element-wise index copy runs at a fraction of memory speed, so the
index is cut, once, into runs of consecutive elements: one batched `_foreach_copy_` moves the runs
(rank 0's own shards straight from the params, with no send copy), and only what lies in short runs
(rows that a layout permutes) goes through `index_copy_`, unless the layout can give its order as a strided
view of the output (`strided`, e.g. RoPE rows of a whole param): that param is one strided copy. On GPU the pack and the scatter are replayed
from CUDA graphs captured once (their buffers never move): launching a 448-input `cat` and the scatter
cost more host time than their kernels (gather p50 0.36 -> 0.26 ms on 2 x H100). The collective stays
outside the graphs. Every rank must call `gather` in the same order: it is a collective.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from titan_lora.lora.layer import local_part
from titan_lora.transfer.buckets import ALIGN, checksum_words, format_checksum
from titan_lora.transfer.cuda_graphs import GraphedReads, captured
from titan_lora.transfer.host_copy import HostCopies
from titan_lora.transfer.kernels import finite_and_checksum
from titan_lora.transfer.transport import plain_buffer

# Maps a tensor of output positions, laid out as the output wants the param, into the trainer's
# layout of that param (e.g. undoing a row permutation), so the scatter writes the output layout. A layout
# that also has `strided(out) -> view` gives the same order as a view of the output (`export.peft.TitanRopeOrder`).
Layout = Callable[[torch.Tensor], torch.Tensor]
# (numel, dtype, device) -> a zeroed tensor to gather into, and the buffer it lies in (or None). The
# emitter lends it, so that a transport's buffer receives the gather and goes out with no packing copy.
Lend = Callable[[int, torch.dtype, torch.device], tuple[torch.Tensor, object | None]]


def sends_its_part(param: torch.Tensor, dst_global: int) -> bool:
    """True when this rank sends its local part of `param`, so that one copy of each element reaches
    rank `dst_global`: a plain tensor (replicated, e.g. `[lora] replicate_adapters`) only from there; a
    DTensor from the mesh that holds `dst_global` (others, e.g. TP meshes of other data-parallel ranks,
    hold copies), and there only from coordinate 0 of each dimension it is replicated on."""
    if not isinstance(param, DTensor):
        return dist.get_rank() == dst_global if dist.is_initialized() else True
    mesh = param.device_mesh
    if dst_global not in mesh.mesh.flatten().tolist():
        return False
    coordinate = mesh.get_coordinate() or []
    return all(c == 0 for c, placement in zip(coordinate, param.placements) if placement.is_replicate())


def _global_flat_index(param: torch.Tensor, offset: int, layout: Layout | None,
                       out_shape: tuple[int, ...]) -> torch.Tensor:
    """Positions, in the flat output buffer, of this rank's local elements of `param`."""
    positions = torch.arange(offset, offset + param.numel(), dtype=torch.int64).view(out_shape)
    if layout is not None:  # the output holds the param in another order: move positions with it
        positions = layout(positions)
    if not isinstance(param, DTensor):
        return positions.reshape(-1)
    # Sharding the position tensor with the param's own placements yields exactly its local positions.
    shard = distribute_tensor(positions, param.device_mesh, param.placements, src_data_rank=None)
    return shard.to_local().reshape(-1)


WORD = torch.int64  # the widest word the index scatter moves


def word_index(index: torch.Tensor, element_size: int) -> tuple[int, torch.Tensor]:
    """(w, index of w-element words) for the widest w <= 8 bytes such that `index` moves only whole,
    aligned words of w elements (w = 1: the element index itself)."""
    for w in (8 // element_size, 4 // element_size, 2 // element_size):
        if w <= 1 or index.numel() % w:
            continue
        groups = index.view(-1, w)
        first = groups[:, :1]
        if bool((first % w == 0).all()) and bool((groups == first + torch.arange(w, device=index.device)).all()):
            return w, first.reshape(-1) // w
    return 1, index


# Runs shorter than this are scattered element-wise: a batched copy of tiny pieces costs more.
MIN_RUN = 64


class _RunPlan:
    """The CPU scatter: long runs as (source view, output view) pairs; the elements of short runs are
    staged side by side and placed with a single `index_copy_`."""

    def __init__(self, out: torch.Tensor, limit: int) -> None:
        self.out = out
        self.limit = limit  # positions from here on are padding
        self.srcs: list[torch.Tensor] = []
        self.dsts: list[torch.Tensor] = []
        # (source, which of its elements or None for all, their output positions)
        self._short: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]] = []
        self._copies: HostCopies | None = None  # the long runs' copies, split over two threads
        self._stage = self._stage_index = torch.empty(0)
        self._whole: list[torch.Tensor] = []
        self._whole_numel = 0
        self._picked: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def add_strided(self, source: torch.Tensor, out_view: torch.Tensor) -> None:
        """Plan copying contiguous `source`, in order, into `out_view` (a strided view of the output)."""
        self.srcs.append(source.view(out_view.shape))
        self.dsts.append(out_view)

    def add(self, source: torch.Tensor, index: torch.Tensor) -> bool:
        """Plan moving source[i] to out[index[i]] for every i (index >= limit is padding); True where some
        go by index (short runs)."""
        if index.numel() == 0:
            return False
        breaks = torch.nonzero(index[1:] - index[:-1] != 1).flatten() + 1
        starts = torch.cat([index.new_zeros(1), breaks])
        lengths = torch.diff(starts, append=index.new_tensor([index.numel()]))
        real = index[starts] < self.limit
        long = real & (lengths >= MIN_RUN)
        for start, length in zip(starts[long].tolist(), lengths[long].tolist()):
            first = int(index[start])
            self.srcs.append(source[start : start + length])
            self.dsts.append(self.out[first : first + length])
        picks = torch.nonzero(torch.repeat_interleave(real & (lengths < MIN_RUN), lengths)).flatten()
        if picks.numel():
            whole = picks.numel() == source.numel()  # e.g. a row-permuted param: no pick needed
            self._short.append((source, None if whole else picks, index[picks]))
        return bool(picks.numel())

    def finish(self) -> _RunPlan:
        """Fix the staging layout and the thread split once every source is added."""
        self._copies = HostCopies(self.dsts, self.srcs)
        self._whole = [src for src, picks, _ in self._short if picks is None]
        picked = [(src, picks, idx) for src, picks, idx in self._short if picks is not None]
        indices = [idx for _, picks, idx in self._short if picks is None] + [idx for _, _, idx in picked]
        self._stage_index = torch.cat(indices) if indices else torch.empty(0, dtype=torch.int64)
        self._stage = self.out.new_empty(self._stage_index.numel())
        offset = self._whole_numel = sum(src.numel() for src in self._whole)
        for src, picks, _ in picked:
            self._picked.append((src, picks, self._stage[offset : offset + picks.numel()]))
            offset += picks.numel()
        return self

    def run(self) -> None:
        """Move every planned element into the output."""
        self._copies.run()
        if not self._stage.numel():
            return
        if self._whole:
            torch.cat(self._whole, out=self._stage[: self._whole_numel])
        for src, picks, stage in self._picked:
            torch.index_select(src, 0, picks, out=stage)
        self.out.index_copy_(0, self._stage_index, self._stage)


def aligned_offsets(numels: Sequence[int], element_size: int, align: int = ALIGN) -> list[int]:
    """Element offsets of tensors laid out back to back, each starting on an `align`-byte boundary."""
    step = max(align // element_size, 1)
    offsets = [0]
    for n in numels:
        offsets.append((offsets[-1] + n + step - 1) // step * step)
    return offsets


class ShardGatherer:
    """Preallocated, single-collective gather of a fixed list of (possibly sharded) params to rank 0."""

    def __init__(
        self,
        named_params: Sequence[tuple[str, torch.Tensor]],
        group: dist.ProcessGroup | None = None,
        dst: int = 0,
        layouts: Sequence[Layout | None] | None = None,
        scatter: str | None = None,
        lend: Lend = plain_buffer,
        cuda_graphs: bool = True,
        out_shapes: Sequence[tuple[int, ...] | None] | None = None,
    ) -> None:
        """`scatter`: "runs" or "index"; by default runs on CPU and one index_copy_ elsewhere. `lend`
        gives rank 0 its output buffer (the emitter's, to hand the engine with no copy). `cuda_graphs`:
        on GPU with the index scatter, replay the pack and the scatter from CUDA graphs. `layouts` and
        `out_shapes` (None: the param's) say how each output holds its param."""
        if not named_params:
            raise ValueError("no adapter parameters to gather: is the `lora` converter enabled?")
        dtypes = {p.dtype for _, p in named_params}
        if len(dtypes) != 1:
            raise ValueError(f"adapter params must share one dtype to be gathered together, got {dtypes}")
        self.names = [n for n, _ in named_params]
        self.shapes = [tuple(shape or p.shape) for (_, p), shape in
                       zip(named_params, out_shapes or [None] * len(named_params))]
        self.dtype = dtypes.pop()
        self.group = group
        self.dst = dst
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        dst_global = dist.get_global_rank(group, dst) if dist.is_initialized() and group is not None else dst
        sends = [sends_its_part(p, dst_global) for _, p in named_params]
        # Flat views of the local shards that this rank sends, made once: FSDP2 keeps each param's storage.
        self._locals = [local_part(p).detach().reshape(-1) for (_, p), s in zip(named_params, sends) if s]
        first = local_part(named_params[0][1])
        device, element_size = first.device, first.element_size()
        layouts = layouts or [None] * len(named_params)
        # Outputs start on bucket-aligned boundaries, so the buffer is already a bucket's layout.
        offsets = aligned_offsets([p.numel() for _, p in named_params], element_size)
        self.total_numel = offsets[-1]
        # From the first tensor's start to the last one's end: the bucket `plan_buckets` makes of them all.
        self.region_bytes = (offsets[-2] + math.prod(self.shapes[-1])) * element_size
        local_indices = [
            _global_flat_index(p, o, lay, shape)
            for (_, p), o, lay, shape, s in zip(named_params, offsets, layouts, self.shapes, sends) if s
        ]
        local_index = torch.cat(local_indices) if local_indices else torch.empty(0, dtype=torch.int64)
        self.local_numel = local_index.numel()
        # Replicated adapters: rank dst holds everything and the others send nothing, so no collective.
        self.collective = self.world > 1 and self._max_over_ranks(
            0 if self.rank == dst else self.local_numel, device) > 0
        self.max_local = (self._max_over_ranks(self.local_numel, device) if self.collective
                          else self.local_numel)

        # Zeros: the graphs' warm-up runs scatter them before any gather.
        self._send = torch.zeros(self.max_local, dtype=self.dtype, device=device)
        is_dst = self.rank == dst
        receives = is_dst and self.collective
        self._recv = torch.zeros(self.world * self.max_local if receives else 0, dtype=self.dtype,
                                 device=device)
        # A word of extra slots at the end soaks up the padding of ranks whose shard is smaller. Zeros:
        # the alignment gaps between tensors are never written and must stay finite.
        self._pad = max(WORD.itemsize // element_size, 1)
        self._full, self.home = (lend(self.total_numel + self._pad, self.dtype, device) if is_dst
                                 else (torch.empty(0, dtype=self.dtype), None))
        self._recv_chunks = list(self._recv.chunk(self.world)) if receives else None
        scatter = scatter or ("runs" if device.type == "cpu" else "index")
        if scatter not in ("runs", "index"):
            raise ValueError(f"scatter must be 'runs' or 'index', got {scatter!r}")
        index = self._gather_index(local_index.to(device), device)
        self._kinds = dict.fromkeys(("runs", "strided", "indexed"), 0)
        self.word = 1
        if scatter == "index":
            self._index, self._runs = index, None
            if index is not None:
                self.word, self._index = word_index(index, element_size)
        else:
            strided = [self._strided_view(p, o, lay, shape) if is_dst else None
                       for (_, p), o, lay, shape, s in zip(named_params, offsets, layouts, self.shapes, sends) if s]
            self._index, self._runs = None, self._run_plan(index, local_indices, strided)
        self.views = {
            name: self._full[offsets[i] : offsets[i] + math.prod(shape)].view(shape)
            for i, (name, shape) in enumerate(zip(self.names, self.shapes))
        } if is_dst else {}
        self._pack_graph = self._scatter_graph = None
        self._reads = GraphedReads(size=1)
        if cuda_graphs and device.type == "cuda" and self._runs is None and (is_dst or self.collective):
            self._pack_graph = captured(self._pack, device)
            self._scatter_graph = captured(self.scatter, device) if is_dst else None

    @property
    def graphed(self) -> bool:
        """True when the pack (and on rank `dst` the scatter) replay from CUDA graphs."""
        return self._pack_graph is not None

    def scatter_kinds(self) -> dict[str, int]:
        """How many of rank `dst`'s own params the CPU scatter moves in runs, as one strided copy, or partly
        by index (none with the index scatter)."""
        return dict(self._kinds)

    @property
    def nbytes(self) -> int:
        """Bytes of the gathered tensors (alignment padding excluded)."""
        return sum(math.prod(s) for s in self.shapes) * self._send.element_size()

    def _max_over_ranks(self, n: int, device: torch.device) -> int:
        if self.world == 1:
            return n
        t = torch.tensor([n], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t.item())

    def _strided_view(self, param: torch.Tensor, offset: int, layout: Layout | None,
                      shape: tuple[int, ...]) -> torch.Tensor | None:
        """The output place of a whole plain `param` whose layout is a strided view, as that view; else None."""
        if isinstance(param, DTensor) or not hasattr(layout, "strided"):
            return None
        return layout.strided(self._full[offset : offset + param.numel()].view(shape))

    def _run_plan(self, index: torch.Tensor | None, local_indices: list[torch.Tensor],
                  strided: list[torch.Tensor | None]) -> _RunPlan | None:
        """On rank `dst`: runs from its own params (or one strided copy each, where `strided` has a view)
        and from the other ranks' parts of the receive buffer."""
        if index is None:
            return None
        plan = _RunPlan(self._full, self.total_numel)
        for local, own, view in zip(self._locals, local_indices, strided):
            if view is not None:
                plan.add_strided(local, view)
                kind = "strided"
            else:
                kind = "indexed" if plan.add(local, own) else "runs"
            self._kinds[kind] += 1
        if self.collective:
            chunks = zip(self._recv.chunk(self.world), index.chunk(self.world))
            for r, (chunk, chunk_index) in enumerate(chunks):
                if r != self.dst:
                    plan.add(chunk, chunk_index)
        return plan.finish()

    def _gather_index(self, local_index: torch.Tensor, device: torch.device) -> torch.Tensor | None:
        # Padding goes to the spare slots past the end, a word's worth, so that whole words stay whole.
        spare = torch.arange(self.max_local, dtype=torch.int64, device=device) % self._pad
        padded = self.total_numel + spare
        padded[: local_index.numel()] = local_index
        if not self.collective:
            return padded if self.rank == self.dst else None
        out = [torch.empty_like(padded) for _ in range(self.world)] if self.rank == self.dst else None
        dist.gather(padded, out, dst=self.dst, group=self.group)
        return torch.cat(out) if out is not None else None

    @torch.no_grad()
    def gather(self) -> dict[str, torch.Tensor] | None:
        """Collective. On rank `dst`: {name: full tensor} (views reused by the next call); else None."""
        is_dst = self.rank == self.dst
        if not is_dst and not self.collective:
            return None
        if self._pack_graph is not None:
            self._pack_graph.replay()
        elif not is_dst or self._runs is None:  # the run plan reads rank dst's own shards in place
            self._pack()
        if self.collective:
            dist.gather(self._send, self._recv_chunks, dst=self.dst, group=self.group)
        if not is_dst:
            return None
        if self._scatter_graph is not None:
            self._scatter_graph.replay()
        else:
            self.scatter()
        return self.views

    def _pack(self) -> None:
        if self._locals:
            torch.cat(self._locals, out=self._send[: self.local_numel])

    def scatter(self) -> None:
        """Rank `dst`, after the collective: place every received element (the benchmark times it alone)."""
        if self._runs is not None:
            self._runs.run()
            return
        src = self._recv if self.collective else self._send
        if self.word > 1:
            self._full.view(WORD).index_copy_(0, self._index, src.view(WORD))
        else:
            self._full.index_copy_(0, self._index, src)

    def finite_and_checksum(self) -> tuple[bool, str]:
        """Rank `dst`: whether the last gathered tensors hold no NaN or Inf, and the `bucket_checksum` of
        the output's `region_bytes` (the one bucket that holds them all), with one host read for both:
        each read after the gather waits on the GPU, and an emitter that sends that bucket needs no
        checksum pass of its own. On a GPU, one Triton kernel reads the bytes once for both (`kernels`).

        The kernel counts NaN and Inf exactly. Without it (CPU, no Triton) the check is a sum: NaN and
        Inf propagate through it, so a finite sum proves every element finite (one pass, no mask); only
        a non-finite sum, which an overflow could also give, is checked per element.
        """
        full = self._full[: self.total_numel]
        fused = finite_and_checksum(self._full[: self.region_bytes // full.element_size()])  # one read
        if fused is not None:
            return fused
        region = self._full.view(torch.uint8)[: self.region_bytes]

        def reads() -> torch.Tensor:
            return torch.cat([checksum_words(region), torch.isfinite(full.sum()).to(torch.int64).view(1)])

        if full.is_cuda and self.graphed:  # its buffers never move: replayed from a graph, as the gather
            plain, weighted, finite = self._reads.read("finite_and_checksum", full.device, reads)
        else:
            plain, weighted, finite = reads().tolist()
        finite = bool(finite) or bool(torch.isfinite(full).all())
        return finite, format_checksum(plain, weighted, region.numel())

"""CUDA graphs for short device work on buffers that never move, whose launches cost more host time than
its kernels: the gather's pack and scatter (`sync/gather.py`) and the checksum of a bucket buffer.

Only for buffers that recur: a capture synchronizes the device and empties the allocator cache, which
costs far more than the launches it saves on work that runs once (a base bucket: `engines/transfers.py`).
`capture_count` says how many were taken, for the tests and benchmarks that check it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable

import torch


_captures = 0
_captures_lock = threading.Lock()


def capture_count() -> int:
    """CUDA graphs captured by this process so far."""
    return _captures


def captured(work: Callable[[], object], device: torch.device) -> torch.cuda.CUDAGraph:
    """`work` (device work on buffers that never move, no host sync) as a CUDA graph, warmed up first on a
    side stream as capture requires. Other threads may use the device meanwhile (thread-local capture)."""
    global _captures
    with _captures_lock:
        _captures += 1
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        work()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        work()
    return graph


class GraphedReads:
    """Device work that yields a small tensor, captured once per key (the addresses it reads) and replayed
    after; `read` returns the tensor's values on the host. Thread-safe; the least recently used of more
    than `size` graphs is dropped."""

    def __init__(self, size: int = 32) -> None:
        self.size = size
        self._graphs: OrderedDict[Hashable, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = OrderedDict()
        self._lock = threading.Lock()

    def read(self, key: Hashable, device: torch.device, work: Callable[[], torch.Tensor]) -> list:
        """`work()`'s values, from its graph for `key` (captured on the first call)."""
        with self._lock:  # one replay at a time: the output tensor is the graph's own
            hit = self._graphs.get(key)
            if hit is None:
                out: list[torch.Tensor] = []
                graph = captured(lambda: out.append(work()), device)
                hit = self._graphs[key] = (graph, out[-1])
                while len(self._graphs) > self.size:
                    self._graphs.popitem(last=False)
            else:
                self._graphs.move_to_end(key)
            hit[0].replay()
            return hit[1].tolist()

"""Where buckets travel: shared memory on one host (CPU), CUDA IPC when the engine shares the GPU.

The trainer owns the buffers; the engine opens them from a JSON descriptor, copies a bucket out and
acknowledges. Descriptors are plain JSON (no pickle crosses from one side to the other).
"""

from __future__ import annotations

import atexit
import base64
import collections
import json
import os
import stat
import threading
from multiprocessing import shared_memory

import torch
import torch.multiprocessing.reductions as reductions

from titan_lora.transfer.errors import check_name

SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared memory


class BucketBuffer:
    """A trainer-owned byte buffer that an engine process can map."""

    def __init__(self, size: int, device: torch.device) -> None:
        self.size = size
        self.device = device
        self._shm: shared_memory.SharedMemory | None = None
        if device.type == "cpu":
            self._shm = shared_memory.SharedMemory(create=True, size=size)
            try:
                # tmpfs grants any size at ftruncate and fails at first touch (SIGBUS): reserve now.
                os.posix_fallocate(self._shm._fd, 0, size)
            except OSError as err:
                self._shm.close()
                self._shm.unlink()
                raise OSError(f"cannot reserve {size / 2**20:.0f} MiB of shared memory in {SHM_DIR} ({err}): "
                              "enlarge it (docker: --shm-size) or lower [weight_sync] bucket_mb") from err
            self._shm.close()  # only the name is kept: torch maps the segment itself
            self.tensor = _map_shm(self._shm.name, size)
        elif device.type == "cuda":
            self.tensor = torch.empty(size, dtype=torch.uint8, device=device)
        else:
            raise ValueError(f"no bucket transport for device type {device.type!r}")
        # Once: every CUDA share takes a new slot in torch's IPC ref-counter files (cuda.shm.*) that the
        # producer keeps until the receiver lets go; sharing again on every post (~15k posts) ended in
        # a segfault at exit and left cuda.shm.* files behind (issue 9).
        self._desc = self._describe()

    def describe(self, offset: int = 0) -> dict:
        """The JSON descriptor the engine opens the buffer with; the bucket starts `offset` bytes in."""
        return {**self._desc, "offset": offset}

    def _describe(self) -> dict:
        if self._shm is not None:
            return {"kind": "shm", "name": self._shm.name, "size": self.size}
        _, args = reductions.reduce_tensor(self.tensor)
        (_, size, stride, tensor_offset, _, _, device, handle, storage_bytes, storage_offset, _,
         ref_handle, ref_offset, event_handle, event_sync) = args
        b64 = lambda b: base64.b64encode(b).decode()  # noqa: E731
        # `handle` names the cudaMalloc segment; `storage_offset` says where this buffer lies in it.
        return {"kind": "cuda_ipc", "size": list(size), "stride": list(stride),
                "tensor_offset": tensor_offset, "device": device, "handle": b64(handle),
                "storage_bytes": storage_bytes,
                "storage_offset": storage_offset, "ref_handle": b64(ref_handle), "ref_offset": ref_offset,
                "event_handle": b64(event_handle) if event_handle else "", "event_sync": event_sync}

    def synchronize(self) -> None:
        """Make packed bytes visible to the other process (packing may be asynchronous on GPU)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def close(self) -> None:
        """Release the buffer; the shared-memory segment is removed."""
        del self.tensor
        if self._shm is not None:
            self._shm.unlink()


def _map_shm(name: str, size: int) -> torch.Tensor:
    """`size` bytes of POSIX shared memory `name`, mapped by torch.

    Not `torch.frombuffer` over Python's mapping: that tensor's deleter needs the interpreter, and a
    tensor freed while the interpreter shuts down aborted a process (rank 0 of a 2-rank test, once).
    """
    return torch.from_file(os.path.join(SHM_DIR, name), shared=True, size=size, dtype=torch.uint8)


def make_buffers(n: int, size: int, device: torch.device) -> list[BucketBuffer]:
    """`n` buffers of `size` bytes on `device`."""
    return [BucketBuffer(size, device) for _ in range(n)]


# Lent buffers live as long as the process (their tensors may outlive any owner); names go at exit.
_LENT: list[BucketBuffer] = []


@atexit.register
def _unlink_lent() -> None:
    """Remove the shared-memory names at exit (the mappings go with the process)."""
    for buf in _LENT:
        if buf._shm is not None:
            buf._shm.unlink()


def lend_buffer(numel: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, BucketBuffer | None]:
    """A zeroed tensor that an engine process can map, and the buffer it lies in, so that what is written
    into it goes to the engine with no packing copy. Where the host has no shared memory to spare: a
    plain tensor and None."""
    size = numel * torch.empty(0, dtype=dtype).element_size()
    try:
        buf = BucketBuffer(size, device)
    except (OSError, ValueError, RuntimeError):
        return torch.zeros(numel, dtype=dtype, device=device), None
    _LENT.append(buf)
    return buf.tensor.zero_().view(dtype), buf


def offset_in(buf: BucketBuffer, tensor: torch.Tensor) -> int | None:
    """The byte offset of `tensor` in `buf`, or None when it lies elsewhere."""
    if tensor.untyped_storage().data_ptr() != buf.tensor.untyped_storage().data_ptr():
        return None
    return tensor.data_ptr() - buf.tensor.data_ptr()


def _shm_path(name: str) -> str:
    """The /dev/shm path of a bare segment name; anything else could map an arbitrary file."""
    return os.path.join(SHM_DIR, check_name(name, "shared-memory segment"))


def _open(desc: dict) -> torch.Tensor:
    if desc["kind"] == "shm":
        path = _shm_path(desc["name"])
        # torch.from_file would create a missing file: an engine that cannot see the trainer's
        # shared memory would then read zeros and acknowledge them.
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            st = None
        if st is not None and not stat.S_ISREG(st.st_mode):  # a planted link would map what it points to
            raise ValueError(f"shared memory {path} is not a regular file")
        if st is None or st.st_size < desc["size"]:
            raise FileNotFoundError(
                f"shared memory {path} ({desc['size']} bytes) is not visible here: the engine must run on "
                "the trainer's host and see its /dev/shm (same container or --ipc=host)")
        return _map_shm(desc["name"], desc["size"])
    if desc["kind"] == "cuda_ipc":
        raw = lambda k: base64.b64decode(desc[k]) if desc[k] else b""  # noqa: E731
        return reductions.rebuild_cuda_tensor(
            torch.Tensor, tuple(desc["size"]), tuple(desc["stride"]), desc["tensor_offset"],
            torch.storage.UntypedStorage, torch.uint8, desc["device"], raw("handle"),
            desc["storage_bytes"], desc["storage_offset"], False, raw("ref_handle"),
            desc["ref_offset"], raw("event_handle"), desc["event_sync"],
        )
    raise ValueError(f"unknown bucket transport {desc.get('kind')!r}")


def _mapping_key(desc: dict) -> str:
    """Every field but the bucket offset: buffers of one CUDA segment share its handle and differ in
    `storage_offset`, so the handle alone would hand out another buffer's bytes."""
    return json.dumps({k: v for k, v in desc.items() if k != "offset"}, sort_keys=True)


class BufferCache:
    """Engine side: open each trainer buffer once and reuse the mapping (at most `max_entries`)."""

    def __init__(self, max_entries: int = 32) -> None:
        self.max_entries = max_entries
        self._open: collections.OrderedDict[str, tuple[dict, torch.Tensor]] = collections.OrderedDict()
        self._lock = threading.Lock()  # the engine serves buckets from several threads

    def __len__(self) -> int:
        """Mappings held now."""
        return len(self._open)

    def get(self, desc: dict) -> torch.Tensor:
        """The uint8 tensor behind descriptor `desc`, from its bucket's offset on."""
        key = _mapping_key(desc)
        with self._lock:
            if key in self._open:
                self._open.move_to_end(key)
            else:
                self._open[key] = (desc, _open(desc))
                while len(self._open) > self.max_entries:  # least recently used first; users hold views
                    self._open.popitem(last=False)
            mapped = self._open[key][1]
        return mapped[int(desc.get("offset", 0)) :]

    def clear(self) -> None:
        """Release every mapping. A CUDA mapping's release is what lets the trainer free its IPC
        ref-counter file; an engine that exits still mapping leaves it behind in /dev/shm."""
        with self._lock:
            self._open.clear()

    def prune(self) -> int:
        """Release the mappings of shared-memory segments that no longer exist (their trainer is gone or
        freed them); returns how many were released. CUDA mappings go by the LRU bound alone."""
        with self._lock:
            gone = [key for key, (desc, _) in self._open.items()
                    if desc["kind"] == "shm" and not os.path.exists(os.path.join(SHM_DIR, desc["name"]))]
            for key in gone:
                del self._open[key]
        return len(gone)

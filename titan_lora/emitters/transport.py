"""Where buckets travel: shared memory on one host (CPU), CUDA IPC when the engine shares the GPU.

The trainer owns the buffers; the engine opens them from a JSON descriptor, copies a bucket out and
acknowledges. Descriptors are plain JSON (no pickle crosses from one side to the other).
"""

from __future__ import annotations

import atexit
import base64
import os
from multiprocessing import shared_memory

import torch
import torch.multiprocessing.reductions as reductions

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

    def describe(self, offset: int = 0) -> dict:
        """The JSON descriptor the engine opens the buffer with; the bucket starts `offset` bytes in."""
        return {**self._describe(), "offset": offset}

    def _describe(self) -> dict:
        if self._shm is not None:
            return {"kind": "shm", "name": self._shm.name, "size": self.size}
        _, args = reductions.reduce_tensor(self.tensor)
        (_, size, stride, offset, _, _, device, handle, storage_bytes, storage_offset, _,
         ref_handle, ref_offset, event_handle, event_sync) = args
        b64 = lambda b: base64.b64encode(b).decode()  # noqa: E731
        return {"kind": "cuda_ipc", "size": list(size), "stride": list(stride), "offset": offset,
                "device": device, "handle": b64(handle), "storage_bytes": storage_bytes,
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


# Buffers handed out by `shared_tensor`, by the address of their first byte.
_HOMES: dict[int, BucketBuffer] = {}


@atexit.register
def _unlink_homes() -> None:
    """Remove the shared-memory names at exit (the mappings go with the process)."""
    for buf in _HOMES.values():
        if buf._shm is not None:
            buf._shm.unlink()


def shared_tensor(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor that an engine process can map, so that what is written into it needs no copy
    into a bucket (a plain tensor where the host has no shared memory to spare)."""
    size = numel * torch.empty(0, dtype=dtype).element_size()
    try:
        buf = BucketBuffer(size, device)
    except (OSError, ValueError, RuntimeError):
        return torch.zeros(numel, dtype=dtype, device=device)
    _HOMES[buf.tensor.data_ptr()] = buf  # lives as long as the process: the tensor may outlive any owner
    return buf.tensor.zero_().view(dtype)


def home_of(tensor: torch.Tensor) -> tuple[BucketBuffer, int] | None:
    """The shared buffer that `tensor` lies in and its byte offset there, if `shared_tensor` made it."""
    buf = _HOMES.get(tensor.untyped_storage().data_ptr())
    return None if buf is None else (buf, tensor.data_ptr() - buf.tensor.data_ptr())


def _open(desc: dict) -> torch.Tensor:
    if desc["kind"] == "shm":
        path = os.path.join(SHM_DIR, desc["name"])
        # torch.from_file would create a missing file: an engine that cannot see the trainer's
        # shared memory would then read zeros and acknowledge them.
        if not os.path.exists(path) or os.path.getsize(path) < desc["size"]:
            raise FileNotFoundError(
                f"shared memory {path} ({desc['size']} bytes) is not visible here: the engine must run on "
                "the trainer's host and see its /dev/shm (same container or --ipc=host)")
        return _map_shm(desc["name"], desc["size"])
    if desc["kind"] == "cuda_ipc":
        raw = lambda k: base64.b64decode(desc[k]) if desc[k] else b""  # noqa: E731
        tensor = reductions.rebuild_cuda_tensor(
            torch.Tensor, tuple(desc["size"]), tuple(desc["stride"]), desc["offset"],
            torch.storage.UntypedStorage, torch.uint8, desc["device"], raw("handle"),
            desc["storage_bytes"], desc["storage_offset"], False, raw("ref_handle"),
            desc["ref_offset"], raw("event_handle"), desc["event_sync"],
        )
        return tensor
    raise ValueError(f"unknown bucket transport {desc.get('kind')!r}")


class BufferCache:
    """Engine side: open each trainer buffer once and reuse the mapping."""

    def __init__(self) -> None:
        self._open: dict[str, torch.Tensor] = {}

    def get(self, desc: dict) -> torch.Tensor:
        """The uint8 tensor behind descriptor `desc`, from its bucket's offset on."""
        key = desc.get("name") or desc["handle"]
        if key not in self._open:
            self._open[key] = _open(desc)
        return self._open[key][int(desc.get("offset", 0)) :]

"""CUDA IPC: buckets in the trainer's GPU memory, for an engine process on the same GPU host."""

from __future__ import annotations

import base64

import torch
import torch.multiprocessing.reductions as reductions

from titan_lora.transfer.transports.base import BucketBuffer, Opener, Transport


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


class CudaIpcBuffer(BucketBuffer):
    """Trainer side: a CUDA allocation shared by its IPC handle."""

    kind = "cuda_ipc"

    def _allocate(self) -> torch.Tensor:
        if self.device.type != "cuda":
            raise ValueError(f"cuda_ipc buffers live in GPU memory, but the trainer's device is "
                             f"{self.device}: set [engine] transport = \"auto\" (or \"shm\") for a CPU trainer")
        return torch.empty(self.size, dtype=torch.uint8, device=self.device)

    def _fields(self) -> dict:
        _, args = reductions.reduce_tensor(self.tensor)
        (_, size, stride, tensor_offset, _, _, device, handle, storage_bytes, storage_offset, _,
         ref_handle, ref_offset, event_handle, event_sync) = args
        # `handle` names the cudaMalloc segment; `storage_offset` says where this buffer lies in it.
        return {"size": list(size), "stride": list(stride), "tensor_offset": tensor_offset, "device": device,
                "handle": _b64(handle), "storage_bytes": storage_bytes, "storage_offset": storage_offset,
                "ref_handle": _b64(ref_handle), "ref_offset": ref_offset,
                "event_handle": _b64(event_handle) if event_handle else "", "event_sync": event_sync}


class CudaIpcOpener(Opener):
    """Engine side: rebuilds the trainer's tensor from its IPC handle (the same GPU memory, no copy)."""

    def open(self, desc: dict) -> torch.Tensor:
        """The CUDA buffer `desc` describes."""
        raw = lambda k: base64.b64decode(desc[k]) if desc[k] else b""  # noqa: E731
        return reductions.rebuild_cuda_tensor(
            torch.Tensor, tuple(desc["size"]), tuple(desc["stride"]), desc["tensor_offset"],
            torch.storage.UntypedStorage, torch.uint8, desc["device"], raw("handle"),
            desc["storage_bytes"], desc["storage_offset"], False, raw("ref_handle"),
            desc["ref_offset"], raw("event_handle"), desc["event_sync"],
        )

    def device(self, desc: dict) -> torch.device:
        """The GPU the buffer lies on (the one `open` rebuilds it on)."""
        return torch.device("cuda", desc["device"])


CUDA_IPC = Transport(CudaIpcBuffer, CudaIpcOpener())

"""POSIX shared memory: buckets in the trainer's host memory, for an engine that sees its /dev/shm."""

from __future__ import annotations

import os
import stat
from multiprocessing import shared_memory

import torch

from titan_lora.transfer.errors import check_name
from titan_lora.transfer.transports.base import BucketBuffer, Opener, Transport

SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared memory


def map_shm(name: str, size: int) -> torch.Tensor:
    """`size` bytes of POSIX shared memory `name`, mapped by torch.

    Not `torch.frombuffer` over Python's mapping: that tensor's deleter needs the interpreter, and a
    tensor freed while the interpreter shuts down aborted a process (rank 0 of a 2-rank test, once).
    """
    return torch.from_file(os.path.join(SHM_DIR, name), shared=True, size=size, dtype=torch.uint8)


def shm_path(name: str) -> str:
    """The /dev/shm path of a bare segment name; anything else could map an arbitrary file."""
    return os.path.join(SHM_DIR, check_name(name, "shared-memory segment"))


class ShmBuffer(BucketBuffer):
    """Trainer side: a segment in /dev/shm, reserved in full, that torch maps by its name."""

    kind = "shm"

    def _allocate(self) -> torch.Tensor:
        self._shm = shared_memory.SharedMemory(create=True, size=self.size)
        try:
            # tmpfs grants any size at ftruncate and fails at first touch (SIGBUS): reserve now.
            os.posix_fallocate(self._shm._fd, 0, self.size)
        except OSError as err:
            self._shm.close()
            self._shm.unlink()
            mib = self.size / 2**20
            raise OSError(f"cannot reserve {mib:.0f} MiB of shared memory in {SHM_DIR} ({err}): "
                          "enlarge it (docker: --shm-size) or lower [weight_sync] bucket_mb") from err
        self._shm.close()  # only the name is kept: torch maps the segment itself
        return map_shm(self._shm.name, self.size)

    def _fields(self) -> dict:
        return {"name": self._shm.name, "size": self.size}

    def unlink(self) -> None:
        """Remove the segment from /dev/shm."""
        self._shm.unlink()


class ShmOpener(Opener):
    """Engine side: maps a bare segment name in /dev/shm, only if it is a regular file of full size."""

    def open(self, desc: dict) -> torch.Tensor:
        """The segment `desc` names; FileNotFoundError where this process cannot see it."""
        path = shm_path(desc["name"])
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
        return map_shm(desc["name"], desc["size"])

    def exists(self, desc: dict) -> bool:
        """Whether the segment is still in /dev/shm (its trainer neither freed it nor died)."""
        return os.path.exists(shm_path(desc["name"]))


SHM = Transport(ShmBuffer, ShmOpener())

"""POSIX shared memory as the tests see it: the segments on the host, those a process maps, and the
clean-up of segments a killed process left behind (without touching other jobs' segments)."""

from __future__ import annotations

import os
import re

SHM = "/dev/shm"
# The CUDA driver's own per-process IPC file, `cuda.shm.<device>.<pid in hex>.<n>` (4 KiB): it leaves one
# for each process that exported a CUDA IPC handle, and keeps it after the process exits
# (docs/benchmarks.md, the IPC soak). Not ours: torch's ref-counter files are `torch_*`, buckets `psm_*`.
CUDA_DRIVER_FILE = re.compile(r"cuda\.shm\.\d+\.[0-9a-f]+\.\d+")


def shm_segments() -> set[str]:
    """The POSIX shared-memory segments on this host."""
    return set(os.listdir(SHM)) if os.path.isdir(SHM) else set()


def cuda_driver_files(names: set[str]) -> set[str]:
    """The CUDA driver's per-process IPC files among `names`."""
    return {n for n in names if CUDA_DRIVER_FILE.fullmatch(n)}


def mapped_segments(pid: int) -> set[str]:
    """The /dev/shm names that process `pid` maps."""
    with open(f"/proc/{pid}/maps") as maps:
        return {line.rsplit("/dev/shm/", 1)[1].split()[0] for line in maps if "/dev/shm/" in line}


def _open_segments(pid: int) -> set[str]:
    fds = f"/proc/{pid}/fd"
    links = (os.readlink(f"{fds}/{fd}") for fd in os.listdir(fds))
    return {os.path.basename(link) for link in links if link.startswith("/dev/shm/")}


def unlink_orphaned(names: set[str]) -> list[str]:
    """Unlink the segments among `names` that no living process maps or holds open (a killed job's
    buffers), leaving those of other jobs on the host alone. Returns the names unlinked."""
    used: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            used |= mapped_segments(int(pid)) | _open_segments(int(pid))
        except OSError:  # the process ended meanwhile, or is not ours to read
            continue
    gone = sorted(names - used)
    for name in gone:
        os.unlink(os.path.join(SHM, name))
    return gone

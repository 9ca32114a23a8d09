"""A process that ends with its parent: Linux's parent-death signal, armed once, shared by the trainer's
ranks, the engine a rank starts, and the engine's own children (the one module all of them may import)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int | None = None, sig: int = signal.SIGKILL) -> bool:
    """On Linux: send this process `sig` when its parent exits; True when armed. `parent`: the pid the parent
    had (None: any but init), so a parent that died before the arming is seen and this process ends now."""
    if not sys.platform.startswith("linux"):
        return False
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)
    if os.getppid() != parent if parent is not None else os.getppid() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return True

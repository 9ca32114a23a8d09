"""The errors both sides of a transfer share: the trainer raises or catches them, the engine raises some."""

from __future__ import annotations

import re


class TransferError(RuntimeError):
    """A transfer failed in a way the trainer should report (not a bug in the caller)."""


class InvalidName(TransferError, ValueError):
    """A name that could reach outside its directory; a ValueError too, so engines answer HTTP 400."""


class EngineWeightsLost(TransferError):
    """The engine no longer holds the base weights (restart, or weights released): resend the base."""


class EngineUnreachable(TransferError):
    """The engine did not answer (not started, restarting, or a wrong address)."""


class EngineDied(EngineUnreachable):
    """The embedded engine's process exited, or stopped answering its health check (hung)."""


class EngineHung(EngineDied):
    """The engine took a request and did not answer within its deadline, or its front answers while the
    part that does the work (vLLM's engine core, a worker, the receiver's transfer path) does not: a
    retry would wait as long again. An embedded engine is killed and restarted; an attached one is
    waited for."""


class LayoutUnknownToEngine(TransferError):
    """The engine does not know a bucket layout id (it restarted): resend the header."""


_SAFE_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")


def check_name(name: str, what: str = "adapter name") -> str:
    """`name` if it is a bare file name (`[A-Za-z0-9._-]+`, not starting with '.'), else InvalidName.

    Adapter names become directories (disk emitter) and segment names become /dev/shm paths, so a
    '/', '..' or NUL in them would write, delete or map files elsewhere.
    """
    if not isinstance(name, str) or not _SAFE_NAME.fullmatch(name):
        raise InvalidName(f"{what} {name!r} is not a bare name: use letters, digits, '.', '_' and '-', "
                          "not starting with '.'")
    return name

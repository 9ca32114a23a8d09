"""The sockets a client has open in any of its threads, so that another thread can end their requests.

A request blocked on a wedged engine waits out its whole timeout (minutes for a rollout). When the
engine is found wedged, `OpenSockets.wake_all` shuts the sockets down: every blocked read returns at
once and its request fails. A close alone would not wake it on Linux.
"""

from __future__ import annotations

import socket
import threading
import weakref


class OpenSockets:
    """A thread-safe set of connected sockets, each woken by `wake_all`. It holds them weakly: a socket
    whose owner is gone (a thread-local connection of a thread that ended) is closed as before, not kept
    open here, where it would hold one of the engine's connection slots forever."""

    def __init__(self) -> None:
        self._socks: weakref.WeakSet[socket.socket] = weakref.WeakSet()
        self._lock = threading.Lock()
        self.wakes = 0
        """How many times `wake_all` ran: a request that began before a wake must not be resent."""

    def add(self, sock: socket.socket | None) -> None:
        """Track `sock` (a connection just made)."""
        if sock is not None:
            with self._lock:
                self._socks.add(sock)

    def discard(self, sock: socket.socket | None) -> None:
        """Stop tracking `sock` (its owner closes it); None (a connection that closed itself) is nothing."""
        if sock is not None:
            with self._lock:
                self._socks.discard(sock)

    def wake_all(self) -> None:
        """Shut every tracked socket down: each blocked request fails now; its owner closes the socket."""
        with self._lock:
            self.wakes += 1
            socks = list(self._socks)
        for sock in socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # already closed or never connected
                pass

"""OpenSockets: `wake_all` ends a read blocked in another thread at once, and a socket whose owner is gone
is not kept open by the set (it would hold one of the engine's capped connection slots for good)."""

from __future__ import annotations

import gc
import socket
import threading
import time

from titan_lora.clients.sockets import OpenSockets


def test_wake_all_ends_a_blocked_read_at_once() -> None:
    a, b = socket.socketpair()
    tracked = OpenSockets()
    tracked.add(a)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(a.recv(1)))
    reader.start()
    time.sleep(0.1)
    started = time.monotonic()
    tracked.wake_all()
    reader.join(5)
    assert not reader.is_alive() and time.monotonic() - started < 1.0 and got == [b""]
    assert tracked.wakes == 1
    a.close()
    b.close()


def test_a_socket_whose_owner_is_gone_is_closed_not_kept() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    tracked = OpenSockets()

    def connect_and_forget() -> None:  # as a thread-local connection of a thread that ends
        tracked.add(socket.create_connection(listener.getsockname()))

    thread = threading.Thread(target=connect_and_forget)
    thread.start()
    thread.join()
    peer, _ = listener.accept()
    gc.collect()
    peer.settimeout(5)
    assert peer.recv(1) == b"", "the forgotten connection stayed open"
    assert len(tracked._socks) == 0
    peer.close()
    listener.close()


def test_a_connection_that_closed_itself_is_nothing_to_discard() -> None:
    tracked = OpenSockets()
    tracked.add(None)  # http.client sets its sock to None once it closed it
    tracked.discard(None)
    assert len(tracked._socks) == 0

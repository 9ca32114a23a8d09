"""The frame wire format both sides import: one length-prefixed JSON object per message, and a reader
that refuses a cut, oversized or non-object frame before it is used."""

from __future__ import annotations

import json
import socket
import struct

import pytest

from titan_lora.transfer.frames import FrameError, recv_frame, send_frame


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    yield a, b.makefile("rb"), b
    a.close()
    b.close()


def test_a_frame_arrives_as_the_object_sent_and_a_clean_close_reads_as_none(pair) -> None:
    a, reader, _ = pair
    sent = [{"route": "bucket", "body": {"checksum": "w64:00", "n": [1, 2.5, None]}}, {"status": 200}]
    for message in sent:
        send_frame(a, message)
    a.shutdown(socket.SHUT_WR)
    assert [recv_frame(reader, 1 << 20), recv_frame(reader, 1 << 20)] == sent
    assert recv_frame(reader, 1 << 20) is None


def _raw(sock: socket.socket, payload: bytes, length: int | None = None) -> None:
    sock.sendall(struct.pack(">I", len(payload) if length is None else length) + payload)


def test_a_frame_over_the_limit_is_refused_with_413_before_its_body_is_read(pair) -> None:
    a, reader, _ = pair
    _raw(a, b"", length=1 << 30)  # the body never comes: reading it would block
    with pytest.raises(FrameError, match="1073741824 bytes is over the limit of 1024") as err:
        recv_frame(reader, 1024)
    assert err.value.status == 413


@pytest.mark.parametrize(("payload", "length", "message"), [
    (b'{"a": 1}', 100, "closed 8 bytes into a frame of 100"),
    (b"not json", None, "not valid JSON"),
    (json.dumps([1, 2]).encode(), None, "must hold a JSON object, got list"),
])
def test_a_cut_or_malformed_frame_is_a_frame_error(pair, payload: bytes, length: int | None, message: str) -> None:
    a, reader, _ = pair
    _raw(a, payload, length)
    a.shutdown(socket.SHUT_WR)
    with pytest.raises(FrameError, match=message) as err:
        recv_frame(reader, 1 << 20)
    assert err.value.status == 400


def test_a_close_inside_the_length_is_a_frame_error(pair) -> None:
    a, reader, _ = pair
    a.sendall(b"\x00\x00")
    a.shutdown(socket.SHUT_WR)
    with pytest.raises(FrameError, match="inside a frame's length"):
        recv_frame(reader, 1 << 20)

"""JsonClient over frames against a real receiver in this process: frames only once INFO offered them,
the same acks and errors as over HTTP, a port that cannot be reached left for HTTP, and a connection
lost mid-request reported as unreachable, never sent again."""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import torch
from dist_helpers import free_port

from titan_lora.clients.http import JsonClient
from titan_lora.engines.frame_server import FrameServer
from titan_lora.engines.receiver import ReceiverService, build_server
from titan_lora.transfer.buckets import bucket_checksum, bucket_size, layout_id, pack, plan_buckets
from titan_lora.transfer.errors import EngineHung, EngineUnreachable, LayoutUnknownToEngine, TransferError
from titan_lora.transfer.frames import HELLO_MAX_BYTES, SERVER, proof, recv_frame, send_frame
from titan_lora.transfer.transport import BucketBuffer

KEY = "frames-key"


@pytest.fixture
def engine(monkeypatch) -> Iterator[tuple[str, ReceiverService, FrameServer]]:
    monkeypatch.setenv("TITAN_LORA_API_KEY", KEY)
    http, service, frames = build_server(["--port", str(free_port())], frames=True)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{http.server_address[1]}", service, frames
    for srv in (http, frames):
        srv.shutdown()
        srv.server_close()


@pytest.fixture
def buffer() -> Iterator[BucketBuffer]:
    buf = BucketBuffer(1 << 16, torch.device("cpu"))
    yield buf
    buf.close()


def _bucket(buf: BucketBuffer, seed: int, commit: str | None = None, header: bool = True) -> tuple[dict, str]:
    g = torch.Generator().manual_seed(seed)
    tensors = {f"base_model.model.layers.{i}.q_proj.lora_A.weight": torch.randn(8, 16, generator=g) for i in range(2)}
    (entries,) = plan_buckets(tensors, 1 << 20)
    pack(buf.tensor, entries, tensors)
    checksum = bucket_checksum(buf.tensor[: bucket_size(entries)])
    body = {"transfer_id": uuid.uuid4().hex, "kind": "adapter", "segment": buf.describe(),
            "layout": layout_id(entries), "checksum": checksum}
    if header:
        body["header"] = [e.to_json() for e in entries]
    if commit:
        body["commit"] = {"name": commit, "version": int(commit.rsplit("v", 1)[1]), "peft_config": {}}
    return body, checksum


def test_buckets_go_as_frames_once_info_offered_them_with_the_same_acks(engine, buffer) -> None:
    url, service, frames = engine
    client = JsonClient(url, KEY)
    over, real = [], client._http_post
    client._http_post = lambda path, body, timeout_s: over.append(path) or real(path, body, timeout_s)
    body, checksum = _bucket(buffer, 1, "policy-v1")
    over_http = client.post("/titan/bucket", body)  # nothing offered yet: HTTP
    assert client.post("/titan/info")["frames_port"] == frames.port
    body, checksum = _bucket(buffer, 1, "policy-v2")
    over_frames = client.post("/titan/bucket", body)
    assert over_frames["checksum"] == over_http["checksum"] == checksum
    assert over_frames["commit"]["name"] == "policy-v2" and sorted(service.adapters) == ["policy-v1", "policy-v2"]
    assert {k for k in over_frames if k != "copy_ms"} == {k for k in over_http if k != "copy_ms"}
    # Errors read as over HTTP: a checksum that does not match, an unknown layout.
    body, _ = _bucket(buffer, 2, "policy-v3")
    body["checksum"] = f"w64:{0:032x}:{body['checksum'].rsplit(':', 1)[1]}"
    with pytest.raises(TransferError, match=r"/titan/bucket \(frames\) failed with HTTP 400.*checksum mismatch"):
        client.post("/titan/bucket", body)
    with pytest.raises(LayoutUnknownToEngine):
        client.post("/titan/bucket", {**_bucket(buffer, 3, header=False)[0], "layout": "never-sent"})
    assert sorted(service.adapters) == ["policy-v1", "policy-v2"]
    client.post("/titan/unload", {"name": "policy-v1"})
    assert sorted(service.adapters) == ["policy-v2"]
    assert over == ["/titan/bucket", "/titan/info"], "after the offer, every framed route went as frames"


def test_a_frames_port_that_cannot_be_reached_is_left_for_http(engine, buffer, caplog) -> None:
    url, service, _ = engine
    service.frames_port = closed = free_port()  # an offer nobody listens on (a firewall, another host)
    client = JsonClient(url, KEY)
    client.post("/titan/info")
    body, checksum = _bucket(buffer, 4, "policy-v4")
    with caplog.at_level(logging.WARNING):
        assert client.post("/titan/bucket", body)["checksum"] == checksum  # over HTTP, once refused
    assert f"frames port {closed}" in caplog.text and "sending over HTTP instead" in caplog.text
    client.post("/titan/info")
    assert client._frames is None, "a refused port is not tried again"
    caplog.clear()
    client.post("/titan/bucket", _bucket(buffer, 5, "policy-v5")[0])
    assert "frames" not in caplog.text and sorted(service.adapters) == ["policy-v4", "policy-v5"]


def _half_engine(hang_up: threading.Event, incarnation: str) -> tuple[socket.socket, list[dict]]:
    """A frames port that greets as engine `incarnation`, reads one request and never answers it; it
    hangs up once `hang_up` is set: an engine killed, or hung, mid-request."""
    listener = socket.create_server(("127.0.0.1", 0))
    seen: list[dict] = []

    def serve() -> None:
        conn, _ = listener.accept()
        reader = conn.makefile("rb")
        send_frame(conn, {"challenge": "s1"})
        theirs = recv_frame(reader, HELLO_MAX_BYTES)["challenge"]
        send_frame(conn, {"status": 200, "incarnation": incarnation,
                          "proof": proof(KEY, SERVER, theirs, "s1", incarnation)})
        request = recv_frame(reader, 1 << 20)
        if request is not None:  # None: the client hung up without a request
            seen.append(request)
        hang_up.wait(30)
        conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return listener, seen


def test_a_connection_lost_mid_request_is_unreachable_and_never_sent_again(engine, buffer) -> None:
    url, service, _ = engine
    hang_up = threading.Event()
    hang_up.set()
    listener, seen = _half_engine(hang_up, service.incarnation)
    service.frames_port = listener.getsockname()[1]
    client = JsonClient(url, KEY)
    client.post("/titan/info")
    body, _ = _bucket(buffer, 6, "policy-v6")
    with pytest.raises(EngineUnreachable, match=r"\(frames port \d+\): the engine closed the connection"):
        client.post("/titan/bucket", body)
    assert [s["body"]["transfer_id"] for s in seen] == [body["transfer_id"]]
    assert service.adapters == {}, "the request was not sent again over HTTP"
    assert client._frames is not None, "the offer stands: the next request connects anew"
    listener.close()


def test_a_request_with_no_reply_times_out_as_hung(engine) -> None:
    url, service, _ = engine
    hang_up = threading.Event()
    listener, seen = _half_engine(hang_up, service.incarnation)
    service.frames_port = listener.getsockname()[1]
    client = JsonClient(url, KEY)
    client.post("/titan/info")
    with pytest.raises(EngineHung, match=r"\(frames port \d+\): no answer within 0.3 s"):
        client.post("/titan/unload", {"name": "policy-v1"}, timeout_s=0.3)
    assert seen == [{"route": "unload", "body": {"name": "policy-v1"}}]
    assert client._frames is not None, "one slow unload (the retirer's) does not turn frames off"
    hang_up.set()
    listener.close()


def test_a_port_that_greets_as_another_engine_is_left_for_http(engine, buffer, caplog) -> None:
    url, service, _ = engine
    hang_up = threading.Event()
    hang_up.set()
    listener, seen = _half_engine(hang_up, "an-engine-that-restarted")  # the port outlived its engine
    service.frames_port = listener.getsockname()[1]
    client = JsonClient(url, KEY)
    client.post("/titan/info")
    body, checksum = _bucket(buffer, 7, "policy-v7")
    with caplog.at_level(logging.WARNING):
        assert client.post("/titan/bucket", body)["checksum"] == checksum
    assert seen == [] and "not engine" in caplog.text and sorted(service.adapters) == ["policy-v7"]
    listener.close()


def test_after_a_reply_that_ends_the_connection_the_next_request_connects_anew(engine, buffer) -> None:
    url, service, frames = engine
    frames.max_frame_bytes = 256  # this bucket's request (with its header) is larger
    client = JsonClient(url, KEY)
    client.post("/titan/info")
    body, _ = _bucket(buffer, 8, "policy-v8")
    with pytest.raises(TransferError, match=r"\(frames\) failed with HTTP 413.*over the limit of 256 bytes"):
        client.post("/titan/bucket", body)
    frames.max_frame_bytes = 1 << 20
    assert client.post("/titan/bucket", body)["commit"]["name"] == "policy-v8"


def test_an_https_address_never_takes_the_plain_tcp_offer() -> None:
    client = JsonClient("https://engine.example:8443", KEY)
    client._follow_offer({"frames_port": 9000, "incarnation": "x"})
    assert client._frames is None


def test_the_key_never_goes_to_a_port_that_cannot_prove_it_holds_it(engine, buffer, caplog) -> None:
    """A process that took the frames port (the engine died, the OS let anyone bind it) greets like an
    engine and forges the welcome: it hears no key and no request, and the bucket goes over HTTP."""
    url, service, _ = engine
    thief = socket.create_server(("127.0.0.1", 0))
    heard: list[bytes] = []

    def listen() -> None:
        conn, _ = thief.accept()
        send_frame(conn, {"challenge": "t1"})
        conn.settimeout(2)
        reader = conn.makefile("rb")
        heard.append(repr(recv_frame(reader, HELLO_MAX_BYTES)).encode())
        send_frame(conn, {"status": 200, "incarnation": service.incarnation, "proof": "0" * 64})
        try:
            heard.append(reader.read(1 << 16) or b"")  # anything sent after the forged welcome
        except OSError:
            pass
        conn.close()

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    service.frames_port = thief.getsockname()[1]
    client = JsonClient(url, KEY)
    client.post("/titan/info")
    body, checksum = _bucket(buffer, 9, "policy-v9")
    with caplog.at_level(logging.WARNING):
        assert client.post("/titan/bucket", body)["checksum"] == checksum
    listener.join(10)
    assert heard and KEY.encode() not in b"".join(heard), heard
    assert b"transfer_id" not in b"".join(heard), "no request went to the port"
    assert "did not prove it holds the API key" in caplog.text and sorted(service.adapters) == ["policy-v9"]
    thief.close()


def test_a_kept_connection_near_its_idle_timeout_is_replaced_before_a_request(engine, buffer) -> None:
    url, service, frames = engine
    frames.idle_timeout_s = 0.6
    client = JsonClient(url, KEY)
    client.post("/titan/info")
    client.post("/titan/bucket", _bucket(buffer, 10, "policy-v10")[0])
    first = client._frames._local.conn[0]
    time.sleep(0.4)  # past half the idle timeout: the server may drop it at any moment now
    client.post("/titan/bucket", _bucket(buffer, 11, "policy-v11")[0])
    assert client._frames._local.conn[0] is not first, "a fresh connection took the request"
    time.sleep(1.0)  # past the timeout: the server closed the (new) connection
    client._frames._local.fresh_until = float("inf")  # a client that did not see it coming: the peek does
    client.post("/titan/bucket", _bucket(buffer, 12, "policy-v12")[0])
    assert sorted(service.adapters) == ["policy-v10", "policy-v11", "policy-v12"]

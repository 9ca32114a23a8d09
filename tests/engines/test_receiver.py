"""The engine side of a transfer, driven over HTTP against a real receiver server in this process:
authentication before the body, body limits, bare segment and adapter names, content checksums,
bounded staging, the engine nonce and the fault-injection pause."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import threading
import uuid

import pytest
import torch
from dist_helpers import free_port

from titan_lora.clients.http import JsonClient
from titan_lora.clients.kinds import LaunchPlan
from titan_lora.clients.launch import EmbeddedEngine
from titan_lora.engines.receiver import build_server, shut_down
from titan_lora.transfer.buckets import bucket_checksum, bucket_size, layout_id, pack, plan_buckets
from titan_lora.transfer.errors import TransferError
from titan_lora.transfer.frames import recv_frame, send_frame
from titan_lora.transfer.transport import BucketBuffer

KEY = "test-key"


@pytest.fixture
def receiver(monkeypatch):
    monkeypatch.setenv("TITAN_LORA_API_KEY", KEY)
    monkeypatch.setenv("TITAN_LORA_ENGINE_NONCE", "nonce-123")
    server, service, _ = build_server(["--port", str(free_port()), "--max-body-mb", "1"])
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server, service
    server.shutdown()
    server.server_close()


@pytest.fixture
def buffer():
    buf = BucketBuffer(1 << 16, torch.device("cpu"))
    yield buf
    buf.close()


def _url(server) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


def _raw(server, head: str, body: bytes = b"") -> tuple[int, dict]:
    """Send a hand-written request; the reply must come without the server reading a missing body."""
    with socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=10) as sock:
        sock.sendall(head.encode() + b"\r\n" + body)
        resp = http.client.HTTPResponse(sock)
        resp.begin()  # a server waiting for the announced body never answers: socket.timeout
        return resp.status, json.loads(resp.read())


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"base_model.model.layers.{i}.self_attn.q_proj.lora_{ab}.weight": torch.randn(8, 16, generator=g)
            for i in range(2) for ab in "AB"}


def _bucket(buf: BucketBuffer, tensors: dict, transfer_id: str,
            kind: str = "adapter") -> tuple[dict, torch.Tensor]:
    """A bucket body for `tensors` packed into `buf`, and the packed bytes (the oracle)."""
    (entries,) = plan_buckets(tensors, 1 << 20)
    pack(buf.tensor, entries, tensors)
    sent = buf.tensor[: bucket_size(entries)].clone()
    body = {"transfer_id": transfer_id, "kind": kind, "segment": buf.describe(), "layout": layout_id(entries),
            "header": [e.to_json() for e in entries], "checksum": bucket_checksum(sent)}
    return body, sent


def test_no_key_is_refused_before_the_body_is_read(receiver) -> None:
    server, _ = receiver
    head = ("POST /titan/bucket HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {1 << 40}\r\n")
    status, reply = _raw(server, head)  # no body follows: only an answer before reading it returns
    assert status == 401 and "API key" in reply["error"]
    status, _ = _raw(server, head.replace("Content-Length", "Authorization: Bearer wrong\r\nContent-Length"))
    assert status == 401


def test_an_oversized_body_is_refused_before_it_is_read(receiver) -> None:
    server, _ = receiver
    head = ("POST /titan/bucket HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {KEY}\r\nContent-Length: {2 << 20}\r\n")
    status, reply = _raw(server, head)
    assert status == 413 and "--max-body-mb" in reply["error"]


def test_a_body_that_is_not_a_json_object_is_refused(receiver) -> None:
    server, _ = receiver
    auth = f"Authorization: Bearer {KEY}\r\n"
    status, reply = _raw(server, f"POST /titan/info HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: text/plain\r\n"
                                 "Content-Length: 2\r\n", b"{}")
    assert status == 415
    status, reply = _raw(server, f"POST /titan/info HTTP/1.1\r\nHost: x\r\n{auth}"
                                 "Content-Type: application/json\r\nContent-Length: 2\r\n", b"[]")
    assert status == 400 and "JSON object" in reply["error"]


def test_info_echoes_the_engine_nonce_and_the_key_comes_from_the_environment(receiver) -> None:
    server, _ = receiver
    assert JsonClient(_url(server), KEY).post("/titan/info")["nonce"] == "nonce-123"
    with pytest.raises(TransferError, match="401"):
        JsonClient(_url(server), "").post("/titan/info")


def test_a_segment_name_with_a_slash_is_refused(receiver, tmp_path, buffer) -> None:
    server, service = receiver
    outside = tmp_path / "not-shm"
    outside.write_bytes(b"\x07" * (1 << 16))  # a file the engine must never map as a "segment"
    body, _ = _bucket(buffer, _tensors(0), uuid.uuid4().hex)
    relative = os.path.relpath(outside, "/dev/shm")
    assert "/" in relative
    body["segment"] = {**body["segment"], "name": relative}
    with pytest.raises(TransferError, match="HTTP 400.*segment .* is not a bare name"):
        JsonClient(_url(server), KEY).post("/titan/bucket", body)
    assert service.transfers.pending() == {}
    with pytest.raises(ValueError, match="has no buckets"):
        service.base({"transfer_id": body["transfer_id"], "version": 1})


def test_an_adapter_name_with_path_characters_is_refused(receiver, buffer) -> None:
    server, service = receiver
    body, _ = _bucket(buffer, _tensors(0), uuid.uuid4().hex)
    body["commit"] = {"name": "../evil", "version": 1, "peft_config": {}}
    with pytest.raises(TransferError, match="HTTP 400.*adapter name .* is not a bare name"):
        JsonClient(_url(server), KEY).post("/titan/bucket", body)
    assert service.adapters == {}


def test_the_ack_carries_the_checksum_of_the_bytes_the_engine_holds(receiver, buffer) -> None:
    server, service = receiver
    tensors = _tensors(1)
    body, sent = _bucket(buffer, tensors, uuid.uuid4().hex)
    body["commit"] = {"name": "policy-v1", "version": 1, "peft_config": {}}
    ack = JsonClient(_url(server), KEY).post("/titan/bucket", body)
    assert ack["checksum"] == bucket_checksum(sent) and ack["tensors"] == 4 and ack["bytes"] == 4 * 8 * 16 * 4
    held = service.adapter_tensors("policy-v1")
    assert all(torch.equal(held[k], v) for k, v in tensors.items())


def test_a_checksum_mismatch_discards_the_transfer_and_commits_nothing(receiver, buffer) -> None:
    server, service = receiver
    client = JsonClient(_url(server), KEY)
    transfer_id = uuid.uuid4().hex
    body, _ = _bucket(buffer, _tensors(2), transfer_id)
    client.post("/titan/bucket", body)  # a first good bucket of the transfer
    body, _ = _bucket(buffer, _tensors(3), transfer_id)
    buffer.tensor[5] ^= 0xFF  # the bytes the engine reads differ from those the checksum covered
    body["commit"] = {"name": "policy-v2", "version": 2, "peft_config": {}}
    with pytest.raises(TransferError, match="HTTP 400.*checksum mismatch"):
        client.post("/titan/bucket", body)
    assert service.adapters == {} and service.transfers.pending() == {}
    with pytest.raises(TransferError, match="HTTP 400.*discarded"):  # a late bucket cannot revive it
        client.post("/titan/bucket", _bucket(buffer, _tensors(4), transfer_id)[0])


def test_uncommitted_transfers_are_bounded_per_kind(receiver, buffer) -> None:
    server, service = receiver
    client = JsonClient(_url(server), KEY)
    ids = [uuid.uuid4().hex for _ in range(5)]
    for transfer_id in ids:
        client.post("/titan/bucket", _bucket(buffer, _tensors(5), transfer_id, "adapter")[0])
        client.post("/titan/bucket", _bucket(buffer, _tensors(6), transfer_id + "b", "base")[0])
    assert service.transfers.pending() == {"adapter": 2, "base": 1}
    service.base({"transfer_id": ids[-1] + "b", "version": 7})  # the newest base still commits
    assert service.base_version == 7 and len(service.base_weights) == 4
    with pytest.raises(TransferError, match="discarded"):
        client.post("/titan/bucket", _bucket(buffer, _tensors(5), ids[0], "adapter")[0])


def test_the_fault_hook_pauses_inside_a_bucket_and_touches_the_marker(receiver, buffer, tmp_path,
                                                                      monkeypatch) -> None:
    server, service = receiver
    marker = tmp_path / "in-bucket"
    monkeypatch.setenv("TITAN_LORA_FAULT_BUCKET_PAUSE_S", "3")
    monkeypatch.setenv("TITAN_LORA_FAULT_MARKER", str(marker))
    body, sent = _bucket(buffer, _tensors(7), uuid.uuid4().hex)
    acks: list[dict] = []
    client = JsonClient(_url(server), KEY)
    post = threading.Thread(target=lambda: acks.append(client.post("/titan/bucket", body)))
    post.start()
    for _ in range(200):
        if marker.exists():
            break
        post.join(0.01)
    assert marker.exists() and not acks, "the marker must appear while the bucket is still being handled"
    post.join(30)
    assert acks and acks[0]["checksum"] == bucket_checksum(sent)


def test_sigterm_releases_the_mappings_and_exits_cleanly(tmp_path) -> None:
    """An engine that exits while mapping the trainer's CUDA buffers leaves their IPC ref-counter files in
    /dev/shm: on SIGTERM the receiver must unwind and release its mappings (exit code 0, and it says so)."""
    log = tmp_path / "receiver.log"
    engine = EmbeddedEngine(LaunchPlan("titan_lora.engines.receiver", []), 0, str(log), start_timeout_s=20.0)
    engine.start()  # returns once it answers /titan/info
    try:
        engine.proc.send_signal(signal.SIGTERM)
        assert engine.proc.wait(timeout=30) == 0, log.read_text()
    finally:
        engine.stop()
    assert "mappings released" in log.read_text()


def test_shutdown_closes_kept_connections_before_releasing_the_mappings(monkeypatch, buffer) -> None:
    """The trainer's kept frame connection must not be served after the release: its next bucket would
    map the trainer's buffer again (on a GPU, leaving a CUDA IPC ref-counter file behind at exit)."""
    monkeypatch.setenv("TITAN_LORA_API_KEY", KEY)
    server, service, framed = build_server(["--port", str(free_port())], frames=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    client = JsonClient(_url(server), KEY)
    client.post("/titan/info")
    client.post("/titan/bucket", _bucket(buffer, _tensors(1), uuid.uuid4().hex)[0])  # as a frame
    sock, reader = client._frames._local.conn
    assert len(service.buffers) == 1
    shut_down(server, service, framed, wait_s=5)
    assert len(service.buffers) == 0
    try:
        send_frame(sock, {"route": "bucket", "body": _bucket(buffer, _tensors(2), uuid.uuid4().hex)[0]})
        reply = recv_frame(reader, 1 << 20)
    except OSError:  # reset: closed as well
        reply = None
    assert reply is None and len(service.buffers) == 0, "the kept connection was served after the release"


def test_a_header_that_is_not_the_layout_it_names_is_refused_400(receiver, buffer) -> None:
    server, service = receiver
    body, _ = _bucket(buffer, _tensors(3), uuid.uuid4().hex)
    other, _ = _bucket(buffer, {"x": torch.zeros(4)}, uuid.uuid4().hex)
    with pytest.raises(TransferError, match=r"HTTP 400.*the bucket header is layout"):
        JsonClient(_url(server), KEY).post("/titan/bucket", {**body, "layout": other["layout"]})
    with pytest.raises(TransferError, match="unknown bucket layout"):  # nothing was kept under the id it named (409)
        JsonClient(_url(server), KEY).post("/titan/bucket", {**other, "header": None})

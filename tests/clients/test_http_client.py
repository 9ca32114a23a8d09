"""JsonClient against a local HTTP server that records what arrives: address checks, the key header, one
kept-alive connection per thread (reconnecting once when the server dropped it), timeouts on the socket,
and each error status turned into the error that says what to do."""

from __future__ import annotations

import http.client
import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from titan_lora.clients.http import JsonClient
from titan_lora.transfer.errors import EngineHung, EngineUnreachable, LayoutUnknownToEngine, TransferError


class Recorder(ThreadingHTTPServer):
    """Answers POSTs from a script: {path: (status, body bytes)}; records requests and client ports."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.script: dict[str, tuple[int, bytes]] = {}
        self.requests: list[dict] = []
        self.ports: list[int] = []
        self.close_after = False  # drop the connection after answering (a server-side keep-alive timeout)
        self.stall: threading.Event | None = None  # answer only once it is set (a wedged engine)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.requests.append({"path": self.path, "body": body, "headers": dict(self.headers)})
        self.server.ports.append(self.client_address[1])
        status, reply = self.server.script.get(self.path, (200, b'{"ok": true}'))
        if self.server.stall is not None:
            self.server.stall.wait(30)
        self.send_response(status)
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)
        if self.server.close_after:
            self.close_connection = True

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def server() -> Iterator[Recorder]:
    srv = Recorder()
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.mark.parametrize("url", ["ftp://host:1", "http://", "host:80", "https:///path"])
def test_an_address_that_is_not_http_host_port_is_refused(url: str) -> None:
    with pytest.raises(ValueError) as err:
        JsonClient(url)
    assert str(err.value) == f"engine address {url!r} must look like http://host:port"


def test_ports_default_by_scheme_and_a_trailing_slash_is_dropped() -> None:
    assert JsonClient("https://engine.example/")._port == 443
    plain = JsonClient("http://engine.example//")
    assert (plain._port, plain._host, plain._scheme, plain.base_url) == (80, "engine.example", "http",
                                                                        "http://engine.example")
    assert JsonClient("https://engine.example:8443")._port == 8443
    default = JsonClient("http://h:1")
    assert (default.api_key, default.timeout_s) == ("", 120.0)


def test_a_post_sends_json_and_the_key_and_returns_the_decoded_reply(server: Recorder) -> None:
    server.script["/titan/info"] = (200, b'{"max_loras": 3}')
    client = JsonClient(server.url + "/", api_key="s3cret", timeout_s=7.0)
    assert client.post("/titan/info", {"a": [1, 2]}) == {"max_loras": 3}
    assert client.post("/titan/info") == {"max_loras": 3}
    first, second = server.requests
    assert json.loads(first["body"]) == {"a": [1, 2]} and second["body"] == b"{}"
    assert first["headers"]["Authorization"] == "Bearer s3cret"
    assert first["headers"]["Content-Type"] == "application/json"


def test_without_a_key_no_authorization_header_is_sent(server: Recorder) -> None:
    JsonClient(server.url).post("/x")
    assert "Authorization" not in server.requests[0]["headers"]


def test_an_empty_reply_is_none(server: Recorder) -> None:
    server.script["/empty"] = (200, b"")
    assert JsonClient(server.url).post("/empty") is None


def test_one_connection_is_kept_per_thread_with_nodelay_and_the_timeout(server: Recorder) -> None:
    client = JsonClient(server.url, timeout_s=9.0)
    for _ in range(3):
        client.post("/x")
    assert len(set(server.ports)) == 1, "each request opened a new connection"
    conn = client._local.conn
    assert conn.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    assert conn.sock.gettimeout() == 9.0 and conn.timeout == 9.0
    client.post("/x", timeout_s=2.5)
    assert conn.sock.gettimeout() == 2.5 and conn.timeout == 2.5 and client._local.conn is conn
    other: list[int] = []
    thread = threading.Thread(target=lambda: other.append(client.post("/x") and server.ports[-1]))
    thread.start()
    thread.join(10)
    assert len(set(server.ports)) == 2, "another thread shares no connection"


def test_a_connection_the_server_dropped_is_reopened_once(server: Recorder) -> None:
    client = JsonClient(server.url)
    server.close_after = True
    assert client.post("/x") == {"ok": True}
    assert client.post("/x") == {"ok": True}, "the kept-alive connection was closed by the server"
    assert client.post("/x") == {"ok": True}
    assert len(set(server.ports)) == 3


def test_a_dropped_connection_closes_and_forgets_the_old_one(server: Recorder) -> None:
    client = JsonClient(server.url)
    client.post("/x")
    old = client._local.conn
    client._drop_connection()
    assert client._local.conn is None and old.sock is None
    client._drop_connection()  # nothing to close: no error
    assert client.post("/x") == {"ok": True}


def test_a_server_that_drops_every_request_is_unreachable() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    accepted: list[socket.socket] = []

    def drop() -> None:
        for _ in range(2):
            conn, _ = listener.accept()
            conn.recv(65536)
            accepted.append(conn)
            conn.close()

    thread = threading.Thread(target=drop, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    try:
        with pytest.raises(EngineUnreachable) as err:
            JsonClient(url, timeout_s=5).post("/titan/bucket")
        assert str(err.value).startswith(f"{url}/titan/bucket: ")
        thread.join(5)
        assert len(accepted) == 2, "one reconnect, then the error"
    finally:
        listener.close()


def test_nothing_listening_is_unreachable_naming_the_address() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    with pytest.raises(EngineUnreachable) as err:
        JsonClient(f"http://127.0.0.1:{port}", timeout_s=2).post("/titan/info")
    assert str(err.value).startswith(f"http://127.0.0.1:{port}: ") and "refused" in str(err.value).lower()


def test_a_hung_server_times_out_as_hung_without_a_retry() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    try:
        client = JsonClient(url, timeout_s=30)
        with pytest.raises(EngineHung) as err:  # an EngineUnreachable: the syncer recovers the engine
            client.post("/titan/unload", timeout_s=0.3)
        assert str(err.value) == f"{url}/titan/unload: no answer within 0.3 s"
        assert client._local.conn is None, "a broken connection is not reused"
    finally:
        listener.close()


def test_error_statuses_say_what_to_do(server: Recorder) -> None:
    client = JsonClient(server.url)
    server.script["/auth"] = (401, b"no")
    server.script["/layout"] = (409, b"unknown bucket layout abc")
    server.script["/boom"] = (500, b"x" * 3000)
    server.script["/moved"] = (302, b"elsewhere")
    with pytest.raises(TransferError) as err:
        client.post("/auth")
    assert str(err.value) == (f"{server.url} refused the API key (HTTP 401): set [engine] api_key to the key "
                              "the engine was started with")
    with pytest.raises(LayoutUnknownToEngine) as err:
        client.post("/layout")
    assert str(err.value) == "unknown bucket layout abc"
    with pytest.raises(TransferError) as err:
        client.post("/boom")
    assert str(err.value) == f"{server.url}/boom failed with HTTP 500: " + "x" * 2000
    with pytest.raises(TransferError, match=f"^{server.url}/moved failed with HTTP 302: elsewhere$"):
        client.post("/moved")
    server.script["/ok299"] = (299, b'{"fine": 1}')
    assert client.post("/ok299") == {"fine": 1}


def test_an_https_address_uses_tls(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[tuple] = []

    class Refused:
        def __init__(self, host: str, port: int, timeout: float) -> None:
            self.host, self.port, self.timeout = host, port, timeout

        def connect(self) -> None:
            made.append((type(self).__name__, self.host, self.port, self.timeout))
            raise OSError("TLS handshake failed")

    monkeypatch.setattr(http.client, "HTTPSConnection", Refused)
    with pytest.raises(EngineUnreachable) as err:
        JsonClient("https://engine.example", timeout_s=4.0).post("/x")
    assert made == [("Refused", "engine.example", 443, 4.0)]
    assert str(err.value) == "https://engine.example: TLS handshake failed"


def test_an_address_keeps_every_character_but_trailing_slashes() -> None:
    assert JsonClient("http://engineX:80/X//").base_url == "http://engineX:80/X"


def test_status_300_is_an_error_and_undecodable_bodies_are_quoted_with_replacements(server: Recorder) -> None:
    client = JsonClient(server.url)
    server.script["/multiple"] = (300, b"choose")
    server.script["/layout"] = (409, b"bad \xff layout")
    server.script["/boom"] = (500, b"bad \xfe")
    with pytest.raises(TransferError, match=f"^{server.url}/multiple failed with HTTP 300: choose$"):
        client.post("/multiple")
    with pytest.raises(LayoutUnknownToEngine) as err:
        client.post("/layout")
    assert str(err.value) == "bad \ufffd layout"
    with pytest.raises(TransferError) as err:
        client.post("/boom")
    assert str(err.value) == f"{server.url}/boom failed with HTTP 500: bad \ufffd"


def test_interrupt_ends_a_request_in_flight_at_once_and_it_is_not_resent(server: Recorder) -> None:
    import time

    server.stall = threading.Event()
    client = JsonClient(server.url, timeout_s=60.0)
    raised: list[BaseException] = []

    def post() -> None:
        try:
            client.post("/titan/bucket", {"n": 1})
        except BaseException as err:  # noqa: BLE001 (checked below)
            raised.append(err)

    thread = threading.Thread(target=post)
    thread.start()
    while not server.requests:
        time.sleep(0.01)
    started = time.monotonic()
    client.interrupt("the engine core did not answer LIVE")
    thread.join(5)
    assert time.monotonic() - started < 1.0 and not thread.is_alive()
    assert len(raised) == 1 and isinstance(raised[0], EngineHung)
    assert "abandoned: the engine core did not answer LIVE" in str(raised[0])
    server.stall.set()
    server.stall = None
    assert client.post("/titan/info") == {"ok": True}, "a later request connects afresh"
    assert [r["path"] for r in server.requests] == ["/titan/bucket", "/titan/info"], "the bucket was resent"


def test_a_request_past_its_timeout_is_an_engine_hang(server: Recorder) -> None:
    server.stall = threading.Event()
    with pytest.raises(EngineHung, match=r"/titan/bucket: no answer within 0.3 s"):
        JsonClient(server.url).post("/titan/bucket", timeout_s=0.3)
    server.stall.set()


@pytest.mark.parametrize(("status", "error"),
                         [(504, EngineHung), (500, EngineHung), (200, None), (404, None)])
def test_the_liveness_check_names_a_wedged_engine_behind_a_live_front(server: Recorder, status: int,
                                                                      error: type | None) -> None:
    server.script["/titan/live"] = (status, b'{"error": "TimeoutError: the engine core did not answer"}')
    client = JsonClient(server.url)
    if error is None:
        client.check_live(1.0)
    else:
        with pytest.raises(error, match="its API server answers, but the engine behind it does not"):
            client.check_live(1.0)
    live = [r for r in server.requests if r["path"] == "/titan/live"]
    assert json.loads(live[0]["body"]) == {"timeout_s": 0.8}, "the engine answers before the socket gives up"
    if status == 404:  # an engine from before LIVE: its INFO is asked instead
        assert server.requests[-1]["path"] == "/titan/info"

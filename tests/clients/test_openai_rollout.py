"""The OpenAI rollout client reads the engine's key per request: an embedded engine gets a fresh key at
every start, and the same client must carry the new one."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from titan_lora.clients.http import ApiKey
from titan_lora.clients.openai_rollout import OpenAIRolloutClient


def test_each_request_carries_the_key_of_the_current_incarnation() -> None:
    seen: list[str] = []

    class Models(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            seen.append(self.headers.get("Authorization", ""))
            data = json.dumps({"object": "list", "data": [{"id": "base", "object": "model", "created": 0,
                                                             "owned_by": "x"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:  # noqa: ANN002
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Models)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    key = ApiKey("first-incarnation")
    client = OpenAIRolloutClient(f"http://127.0.0.1:{server.server_address[1]}", key, timeout_s=10)
    client._call(client.client.models.list)
    key.value = "second-incarnation"  # what EmbeddedEngine.start does
    client._call(client.client.models.list)
    assert seen == ["Bearer first-incarnation", "Bearer second-incarnation"]
    server.shutdown()
    server.server_close()

"""The real receiver process for tests, plus two test-only additions.

- A `/titan/digest` route: SHA-256 of every tensor the receiver HOLDS, for the base or one adapter,
  so a test can check the engine's bytes against the trainer's with an oracle of its own.
- `SHIM_FOREIGN_NONCE=1` makes it echo another nonce: an engine the launcher did not start.
- `SHIM_CHILD=<path>` makes it start a child process (as vLLM starts its engine core) and write the
  child's pid to that file.
"""

from __future__ import annotations

import hashlib
import inspect
import os

import torch

from titan_lora.engines import receiver

_info = receiver.ReceiverService.info


def _info_with_foreign_nonce(self: receiver.ReceiverService, req: dict) -> dict:
    out = _info(self, req)
    if os.environ.get("SHIM_FOREIGN_NONCE"):
        out["nonce"] = "someone-else"
    return out


def tensor_digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes (CPU, C order)."""
    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _digest(service: receiver.ReceiverService, req: dict) -> dict:
    held = service.base_weights if req["name"] == "base" else service.adapter_tensors(req["name"])
    return {name: tensor_digest(t) for name, t in (held or {}).items()}


_make_handler = receiver.make_handler


def _handler_with_digest(routes: dict, *args):
    service = inspect.unwrap(routes["info"]).__self__  # a GPU receiver wraps its routes (device per thread)
    return _make_handler({**routes, "digest": lambda req: _digest(service, req)}, *args)


receiver.ReceiverService.info = _info_with_foreign_nonce
receiver.make_handler = _handler_with_digest

if __name__ == "__main__":
    if os.environ.get("SHIM_CHILD"):
        import subprocess
        import sys

        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(os.environ["SHIM_CHILD"], "w") as f:
            f.write(str(child.pid))
    receiver.main()

"""The disk emitter: write a PEFT directory, then have the engine load it with its own disk loader
(`/titan/adapter_from_path` on the `vllm` engine: vLLM's `add_lora` with the directory's path).

It is the baseline the bucket path is measured against (what most frameworks do) and a fallback
when no shared memory or IPC reaches the engine. Base weights still travel in buckets.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import time
from pathlib import Path

from titan_lora.clients.base import AdapterPayload, AdapterSet, Endpoint, bucket_route, log_route
from titan_lora.clients.http import JsonClient
from titan_lora.clients.vllm import VLLMBucketEmitter
from titan_lora.clients.vllm_openai import VLLM
from titan_lora.config import Engine, WeightSync
from titan_lora.export.peft import save_peft_dir
from titan_lora.transfer import protocol
from titan_lora.transfer.errors import check_name
from titan_lora.transfer.protocol import Ack
from titan_lora.transfer.transport import plain_buffer


class DiskEmitter(VLLMBucketEmitter):
    """Adapters through the filesystem (`adapter_config.json` + safetensors), base through buckets."""

    def __init__(self, client: JsonClient, bucket_mb: int, directory: str) -> None:
        super().__init__(client, bucket_mb)
        self._tmp = None if directory else tempfile.TemporaryDirectory(prefix="titan_lora_disk_")
        self.directory = Path(directory or self._tmp.name)

    lend_buffer = staticmethod(plain_buffer)  # the adapter goes through a file: no shared memory needed

    def send_adapter(self, payload: AdapterPayload) -> Ack:
        """Save the adapter to `<directory>/<name>` and ask the engine to load that path."""
        t0 = time.perf_counter()
        path = save_peft_dir(self.directory / check_name(payload.name), payload.tensors, payload.peft_config)
        t1 = time.perf_counter()
        ack = self.client.post(protocol.path(protocol.ADAPTER_FROM_PATH), {
            "name": payload.name, "path": str(path.resolve()), "version": payload.version,
        })
        t2 = time.perf_counter()
        return Ack(ack["version"], ack["tensors"], ack["bytes"],
                   {"pack_ms": (t1 - t0) * 1e3, "transfer_ms": 0.0, "apply_ms": (t2 - t1) * 1e3})

    def send_adapters(self, adapters: AdapterSet) -> list[Ack]:
        """Several adapters: one directory and one engine load each, one after the other (as K one-adapter jobs
        would), not the bucket stream this emitter's base inherits."""
        return [self.send_adapter(part) for part in adapters.parts]

    def retire_adapter(self, name: str, timeout_s: float) -> bool:
        """Unload in the engine, then delete the directory."""
        check_name(name)  # the rmtree below must stay inside the directory
        done = super().retire_adapter(name, timeout_s)
        if done:
            shutil.rmtree(self.directory / name, ignore_errors=True)
        return done

    def close(self) -> None:
        """Free buffers and the temporary directory."""
        super().close()
        if self._tmp is not None:
            self._tmp.cleanup()


def build_disk_emitter(ws: WeightSync, engine: Engine, endpoint: Endpoint) -> DiskEmitter:
    """The disk emitter (PEFT directories loaded by vLLM's own loader) to the engine at `endpoint`."""
    client = JsonClient(endpoint.url, endpoint.api_key, ws.timeout_s)
    emitter = DiskEmitter(client, ws.bucket_mb, engine.disk_dir)
    log_route(endpoint.url, f"as PEFT directories under {emitter.directory} (adapters) and in buckets over "
              f"{bucket_route(emitter.transport)} (the base)")
    return emitter


VLLM_DISK = dataclasses.replace(VLLM, name="vllm-disk", emitter=build_disk_emitter)

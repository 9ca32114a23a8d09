"""The disk emitter writes and deletes only inside its directory: names with path characters are refused
before anything is written, sent or removed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from titan_lora.clients.base import AdapterPayload
from titan_lora.clients.disk import DiskEmitter
from titan_lora.transfer.errors import InvalidName, TransferError, check_name


class RecordingClient:
    """Answers every route as a willing engine would, and records the routes."""

    def __init__(self) -> None:
        self.routes: list[str] = []

    def post(self, route: str, body: dict | None = None, timeout_s: float | None = None) -> dict:
        self.routes.append(route)
        return {"unloaded": True, "version": 1, "tensors": 1, "bytes": 16}


BAD = ["../escaped", "a/b", "/tmp/abs", "..", ".hidden", "nul\0byte", "", "new\nline"]


@pytest.mark.parametrize("name", BAD)
def test_check_name_refuses_path_characters(name: str) -> None:
    with pytest.raises(InvalidName, match="not a bare name"):
        check_name(name)


@pytest.mark.parametrize("name", ["policy-v3", "my_adapter.v10", "A-1"])
def test_check_name_accepts_bare_names(name: str) -> None:
    assert check_name(name) == name


def test_invalid_name_is_an_emitter_error_and_a_value_error() -> None:
    # TransferError: the syncer reports it on every rank; ValueError: an engine answers HTTP 400.
    assert issubclass(InvalidName, TransferError) and issubclass(InvalidName, ValueError)


def test_the_disk_emitter_writes_and_deletes_only_inside_its_directory(tmp_path: Path) -> None:
    disk_dir, outside = tmp_path / "adapters", tmp_path / "victim"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    client = RecordingClient()
    emitter = DiskEmitter(client, bucket_mb=1, directory=str(disk_dir))
    payload = AdapterPayload("../escaped", 1, {"base_model.model.x.lora_A.weight": torch.ones(2, 2)},
                             {"r": 2, "lora_alpha": 2, "target_modules": ["x"]})
    with pytest.raises(InvalidName):
        emitter.send_adapter(payload)
    with pytest.raises(InvalidName):
        emitter.retire_adapter("../victim", timeout_s=1)
    assert not (tmp_path / "escaped").exists(), "the adapter was written outside disk_dir"
    assert (outside / "keep.txt").read_text() == "mine", "a directory outside disk_dir was removed"
    assert client.routes == [], "nothing may reach the engine under a refused name"
    emitter.close()


# ---- what the disk emitter writes, asks and reports -------------------------------------------------


class AckingClient:
    """Answers as the vLLM engine's disk route does, from values of its own; records every request."""

    def __init__(self, unloaded: bool = True) -> None:
        self.requests: list[tuple[str, dict | None, float | None]] = []
        self.unloaded = unloaded

    def post(self, route: str, body: dict | None = None, timeout_s: float | None = None) -> dict:
        self.requests.append((route, body, timeout_s))
        if route == "/titan/unload":
            return {"unloaded": self.unloaded}
        return {"version": 41, "tensors": 7, "bytes": 999}


def _adapter(name: str = "policy-v4") -> AdapterPayload:
    return AdapterPayload(name, 4, {"base_model.model.x.lora_A.weight": torch.arange(4.0).view(2, 2),
                                    "base_model.model.x.lora_B.weight": torch.ones(2, 2)},
                          {"r": 2, "lora_alpha": 4, "target_modules": ["x"]})


def test_the_adapter_is_saved_as_a_peft_directory_and_loaded_by_its_path(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import glob
    import itertools
    import json
    import tempfile

    from safetensors.torch import load_file

    from titan_lora.clients import disk

    clock = itertools.count(100)
    monkeypatch.setattr(disk.time, "perf_counter", lambda: float(next(clock)))
    client = AckingClient()
    temporary = set(glob.glob(f"{tempfile.gettempdir()}/titan_lora_disk_*"))
    emitter = DiskEmitter(client, bucket_mb=2, directory=str(tmp_path / "adapters"))
    assert set(glob.glob(f"{tempfile.gettempdir()}/titan_lora_disk_*")) == temporary, \
        "a configured directory needs no temporary one"
    try:
        assert emitter.client is client and emitter.bucket_bytes == 2 << 20
        ack = emitter.send_adapter(_adapter())
        out = tmp_path / "adapters" / "policy-v4"
        assert client.requests == [("/titan/adapter_from_path",
                                    {"name": "policy-v4", "path": str(out.resolve()), "version": 4}, None)]
        assert json.loads((out / "adapter_config.json").read_text()) == _adapter().peft_config
        saved = load_file(str(out / "adapter_model.safetensors"))
        assert all(torch.equal(saved[n], t) for n, t in _adapter().tensors.items()) and len(saved) == 2
        # the engine's own figures, and the clock: saved 100..101, loaded 101..102
        assert (ack.version, ack.num_tensors, ack.nbytes) == (41, 7, 999)
        assert ack.phases_ms == {"pack_ms": 1e3, "transfer_ms": 0.0, "apply_ms": 1e3}
    finally:
        emitter.close()
    assert out.exists(), "a configured directory is the user's: close leaves it"


@pytest.mark.parametrize("unloaded", [True, False])
def test_retire_unloads_then_deletes_the_directory_only_once_unloaded(tmp_path: Path, unloaded: bool) -> None:
    client = AckingClient(unloaded=unloaded)
    emitter = DiskEmitter(client, bucket_mb=1, directory=str(tmp_path))
    try:
        emitter.send_adapter(_adapter("policy-v2"))
        assert emitter.retire_adapter("policy-v2", timeout_s=6.0) is unloaded
        assert client.requests[-1] == ("/titan/unload", {"name": "policy-v2", "timeout_s": 6.0}, 16.0)
        assert (tmp_path / "policy-v2").exists() is not unloaded
        assert emitter.retire_adapter("policy-v8", timeout_s=1.0) is unloaded, "a missing directory is no error"
    finally:
        emitter.close()


def test_without_a_directory_a_temporary_one_is_used_and_removed_on_close() -> None:
    import tempfile

    emitter = DiskEmitter(AckingClient(), bucket_mb=1, directory="")
    tmp = emitter.directory
    assert tmp.is_dir() and tmp.name.startswith("titan_lora_disk_") and tmp.parent == Path(tempfile.gettempdir())
    emitter.send_adapter(_adapter())
    assert (tmp / "policy-v4" / "adapter_config.json").exists()
    emitter.close()
    assert not tmp.exists()


def test_several_adapters_go_one_directory_and_one_engine_load_each(tmp_path: Path) -> None:
    from titan_lora.clients.base import AdapterSet, send_adapter_set

    client = AckingClient()
    emitter = DiskEmitter(client, bucket_mb=1, directory=str(tmp_path))
    try:
        parts = (_adapter("a-v4"), _adapter("b-v4"))
        acks = send_adapter_set(emitter, AdapterSet(parts, parts[0]))  # not the bucket stream it inherits
        assert [(route, body["name"]) for route, body, _ in client.requests] == [
            ("/titan/adapter_from_path", "a-v4"), ("/titan/adapter_from_path", "b-v4")]
        assert len(acks) == 2 and all((tmp_path / n / "adapter_config.json").exists() for n in ("a-v4", "b-v4"))
    finally:
        emitter.close()

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

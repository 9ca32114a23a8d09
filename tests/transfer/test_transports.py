"""The transport plug-in point: a transport registered from outside titan_lora (here, a file in a
directory both sides see) carries a bucket to the engine side by its descriptor's kind; an unknown kind
is refused naming the registered ones; built-ins load on first use and each device has its default."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest
import torch

from titan_lora.transfer.buckets import bucket_checksum, bucket_size, copy_out, pack, plan_buckets
from titan_lora.transfer.errors import check_name
from titan_lora.transfer.transport import BufferCache, lend_buffer, make_buffers, offset_in
from titan_lora.transfer.transports import base
from titan_lora.transfer.transports.base import (
    BUILT_IN_TRANSPORTS,
    BucketBuffer,
    Opener,
    Transport,
    default_transport,
    register_transport,
    registered_transports,
    transport_named,
)

ROOT = tempfile.gettempdir()  # the directory the trainer and the engine both see


class FileBuffer(BucketBuffer):
    """Trainer side: a file in ROOT, mapped shared."""

    kind = "file"

    def _allocate(self) -> torch.Tensor:
        self.name = f"titan_lora_test_bucket_{uuid.uuid4().hex}"
        with open(os.path.join(ROOT, self.name), "wb") as f:
            f.truncate(self.size)
        return torch.from_file(os.path.join(ROOT, self.name), shared=True, size=self.size, dtype=torch.uint8)

    def _fields(self) -> dict:
        return {"name": self.name, "size": self.size}

    def unlink(self) -> None:
        os.unlink(os.path.join(ROOT, self.name))


class FileOpener(Opener):
    """Engine side: maps a bare file name in ROOT, refusing a missing or short file."""

    def open(self, desc: dict) -> torch.Tensor:
        path = os.path.join(ROOT, check_name(desc["name"], "bucket file"))
        if not os.path.isfile(path) or os.path.getsize(path) < desc["size"]:
            raise FileNotFoundError(f"bucket file {path} ({desc['size']} bytes) is not here")
        return torch.from_file(path, shared=True, size=desc["size"], dtype=torch.uint8)

    def exists(self, desc: dict) -> bool:
        return os.path.exists(os.path.join(ROOT, desc["name"]))


@pytest.fixture(autouse=True)
def own_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a test registers is gone after it."""
    monkeypatch.setattr(base, "_TRANSPORTS", dict(base._TRANSPORTS))
    monkeypatch.setattr(base, "DEVICE_DEFAULTS", dict(base.DEVICE_DEFAULTS))


@pytest.fixture
def file_transport() -> Transport:
    """The toy transport, registered as a plug-in module would."""
    return register_transport(Transport(FileBuffer, FileOpener()))


@pytest.mark.usefixtures("file_transport")
def test_a_registered_transport_carries_a_bucket_to_the_engine_side() -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {f"layers.{i}.lora_{ab}.weight": torch.randn(8, 16, generator=g)
               for i in range(2) for ab in "AB"}
    (entries,) = plan_buckets(tensors, 1 << 20)
    size = bucket_size(entries)
    buf = FileBuffer(256 + size, torch.device("cpu"))
    pack(buf.tensor[256:], entries, tensors)
    desc = json.loads(json.dumps(buf.describe(256)))  # as it crosses to the engine
    assert (desc["kind"], desc["size"], desc["offset"]) == ("file", 256 + size, 256)

    engine_side = BufferCache()
    try:
        mapped = engine_side.get(desc)
        assert mapped.data_ptr() != buf.tensor[256:].data_ptr(), "the engine side maps the file itself"
        owned, got = copy_out(mapped, entries)
        assert bucket_checksum(owned) == bucket_checksum(buf.tensor[256 : 256 + size])
        assert got.keys() == tensors.keys() and all(torch.equal(got[k], t) for k, t in tensors.items())
        assert engine_side.prune() == 0
    finally:
        buf.close()
    assert engine_side.prune() == 1 and len(engine_side) == 0, "the closed buffer's mapping was kept"
    with pytest.raises(FileNotFoundError, match="is not here"):
        engine_side.get(desc)


def test_a_transport_registered_as_a_device_default_is_what_the_trainer_lends_and_buffers_with() -> None:
    before = make_buffers(1, 64, torch.device("cpu"))[0]
    assert before.kind == "shm", "registering a transport changed the default by itself"
    before.close()
    register_transport(Transport(FileBuffer, FileOpener()), default_for="cpu")
    (buf,) = make_buffers(1, 64, torch.device("cpu"))  # as the bucket emitter asks for its buffers
    lent, home = lend_buffer(16, torch.float32, torch.device("cpu"))  # as the gatherer asks
    try:
        assert (buf.kind, home.kind) == ("file", "file")  # the lent one is unlinked at exit, as all are
        lent[4:].fill_(2.5)
        desc = home.describe(offset_in(home, lent[4:]))
        assert torch.equal(BufferCache().get(desc).view(torch.float32), torch.full((12,), 2.5))
    finally:
        buf.close()


@pytest.mark.usefixtures("file_transport")
def test_an_unknown_kind_is_refused_naming_the_registered_ones() -> None:
    with pytest.raises(ValueError) as err:
        BufferCache().get({"kind": "rdma", "name": "x", "size": 8, "offset": 0})
    assert str(err.value) == ("unknown bucket transport 'rdma': this process has cuda_ipc, file, nccl, shm, tcp (a "
                              "plug-in transport must be registered with register_transport in the trainer "
                              "and in the engine process)")
    with pytest.raises(ValueError, match="unknown bucket transport None"):
        BufferCache().get({"name": "x", "size": 8})
    with pytest.raises(ValueError, match=r"unknown bucket transport \['shm'\]"):
        transport_named(["shm"])  # JSON may carry any value: a clear refusal, not a TypeError


@pytest.mark.usefixtures("file_transport")
def test_a_kind_registers_once() -> None:
    with pytest.raises(ValueError) as err:
        register_transport(Transport(FileBuffer, FileOpener()))
    assert str(err.value) == "bucket transport 'file' is already registered"
    assert registered_transports() == ["cuda_ipc", "file", "nccl", "shm", "tcp"]


def test_each_device_has_its_default_transport_and_built_ins_carry_their_kind() -> None:
    assert [transport_named(kind).kind for kind in BUILT_IN_TRANSPORTS] == list(BUILT_IN_TRANSPORTS)
    assert default_transport(torch.device("cpu")).kind == "shm"
    assert default_transport(torch.device("cuda", 1)).kind == "cuda_ipc"
    buf = BucketBuffer(64, torch.device("cpu"))
    try:
        assert type(buf) is transport_named("shm").buffer and buf.describe()["kind"] == "shm"
    finally:
        buf.close()


def test_built_in_transports_are_imported_on_first_use() -> None:
    code = """if True:
        import sys
        import titan_lora.transfer.transport
        from titan_lora.transfer.transports import base
        cuda = "titan_lora.transfer.transports.cuda_ipc"
        assert cuda not in sys.modules, "importing the registry imported CUDA IPC"
        base.transport_named("cuda_ipc")
        assert cuda in sys.modules
    """
    root = str(Path(base.__file__).parents[3])  # the tree under test, wherever pytest runs from
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": root})

"""The emitter protocol's helpers: the registry and its errors, payload sizes, base items, names."""

from __future__ import annotations

import pytest
import torch

from titan_lora.clients import base
from titan_lora.clients.base import AdapterPayload, Endpoint, base_items, build_emitter, register_emitter
from titan_lora.config import WeightSync
from titan_lora.transfer.errors import check_name


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> dict:
    fresh: dict = {}
    monkeypatch.setattr(base, "_EMITTERS", fresh)
    return fresh


def test_a_registered_factory_builds_the_emitter_its_name_selects(registry: dict) -> None:
    @register_emitter("fake")
    def factory(cfg: WeightSync, endpoint: Endpoint) -> tuple:
        return ("built", cfg.bucket_mb, endpoint.url)

    register_emitter("another")(lambda cfg, endpoint: None)
    assert registry["fake"] is factory and base.registered_emitters() == ["another", "fake"]
    assert build_emitter(WeightSync(emitter="fake", bucket_mb=3), Endpoint("http://e:1")) == ("built", 3, "http://e:1")


def test_a_built_in_emitter_is_imported_only_when_built(registry: dict) -> None:
    registry["lazy"] = "titan_lora.clients.disk:build_disk_emitter"
    emitter = build_emitter(WeightSync(emitter="lazy", disk_dir="/tmp"), Endpoint("http://e:1", "k"))
    from titan_lora.clients.disk import DiskEmitter, build_disk_emitter

    assert isinstance(emitter, DiskEmitter) and registry["lazy"] is build_disk_emitter
    assert (emitter.client.base_url, emitter.client.api_key) == ("http://e:1", "k")


def test_a_name_registers_once(registry: dict) -> None:
    register_emitter("fake")(lambda cfg, endpoint: None)
    with pytest.raises(ValueError) as err:
        register_emitter("fake")(lambda cfg, endpoint: None)
    assert str(err.value) == "emitter 'fake' is already registered"


def test_an_unknown_emitter_names_the_known_ones(registry: dict) -> None:
    with pytest.raises(ValueError) as err:
        build_emitter(WeightSync(emitter="nccl"), Endpoint("http://e:1"))
    assert str(err.value) == "[weight_sync] emitter = 'nccl' is not registered; known emitters: none"
    register_emitter("vllm")(lambda cfg, endpoint: None)
    register_emitter("disk")(lambda cfg, endpoint: None)
    with pytest.raises(ValueError) as err:
        build_emitter(WeightSync(emitter="nccl"), Endpoint("http://e:1"))
    assert str(err.value) == "[weight_sync] emitter = 'nccl' is not registered; known emitters: disk, vllm"


def test_payload_sizes() -> None:
    p = AdapterPayload("p-v1", 1, {"a": torch.zeros(3, 2), "b": torch.zeros(5, dtype=torch.bfloat16)}, {})
    assert (p.num_tensors, p.nbytes) == (2, 34)


def test_base_items_takes_a_mapping_or_pairs_lazily() -> None:
    t = torch.ones(1)
    assert list(base_items({"x": t})) == [("x", t)]
    pairs = iter([("y", t)])
    assert base_items(pairs) is pairs


def test_a_name_with_path_characters_is_refused_with_the_rule() -> None:
    with pytest.raises(ValueError) as err:
        check_name("../x", "segment name")
    assert str(err.value) == ("segment name '../x' is not a bare name: use letters, digits, '.', '_' and '-', "
                              "not starting with '.'")
    with pytest.raises(ValueError, match="^adapter name 7 is not"):
        check_name(7)

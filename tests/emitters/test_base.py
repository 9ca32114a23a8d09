"""The emitter protocol's helpers: the registry and its errors, payload sizes, base items, names."""

from __future__ import annotations

import pytest
import torch

from titan_lora.config import WeightSync
from titan_lora.emitters import base
from titan_lora.emitters.base import AdapterPayload, base_items, build_emitter, check_name, register_emitter


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> dict:
    fresh: dict = {}
    monkeypatch.setattr(base, "_EMITTERS", fresh)
    return fresh


def test_a_registered_factory_builds_the_emitter_its_name_selects(registry: dict) -> None:
    @register_emitter("fake")
    def factory(cfg: WeightSync) -> tuple:
        return ("built", cfg.engine_url)

    register_emitter("another")(lambda cfg: None)
    assert registry["fake"] is factory and base.registered_emitters() == ["another", "fake"]
    assert build_emitter(WeightSync(emitter="fake", engine_url="http://e:1")) == ("built", "http://e:1")


def test_a_name_registers_once(registry: dict) -> None:
    register_emitter("fake")(lambda cfg: None)
    with pytest.raises(ValueError) as err:
        register_emitter("fake")(lambda cfg: None)
    assert str(err.value) == "emitter 'fake' is already registered"


def test_an_unknown_emitter_names_the_known_ones(registry: dict) -> None:
    with pytest.raises(ValueError) as err:
        build_emitter(WeightSync(emitter="nccl"))
    assert str(err.value) == "[weight_sync] emitter = 'nccl' is not registered; known emitters: none"
    register_emitter("vllm")(lambda cfg: None)
    register_emitter("disk")(lambda cfg: None)
    with pytest.raises(ValueError) as err:
        build_emitter(WeightSync(emitter="nccl"))
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

"""The emitter protocol's helpers: payload sizes, base items, names, the route weights take to each engine."""

from __future__ import annotations

import pytest
import torch

from titan_lora.clients.base import AdapterPayload, Endpoint, base_items
from titan_lora.clients.vllm import build_vllm_emitter
from titan_lora.config import Engine, WeightSync
from titan_lora.transfer.errors import check_name
from titan_lora.transfer.placement import choose_transport


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


def test_each_engine_emitter_says_at_start_which_transport_carries_its_buckets_and_where(
        caplog: pytest.LogCaptureFixture) -> None:
    engines = {"http://10.0.0.7:8000": choose_transport("tcp", "http://10.0.0.7:8000", "10.0.0.5", 0),
               "http://10.0.0.8:8000": choose_transport("nccl", "http://10.0.0.8:8000", "10.0.0.5", 29600, "gloo"),
               "http://127.0.0.1:8001": choose_transport("shm", "http://127.0.0.1:8001")}
    caplog.set_level("INFO", logger="titan_lora.clients.base")
    for url, transport in engines.items():
        build_vllm_emitter(WeightSync(enabled=True), Engine(), Endpoint(url, "", transport)).close()
    build_vllm_emitter(WeightSync(enabled=True), Engine(), Endpoint("http://127.0.0.1:8002")).close()
    assert [r.getMessage() for r in caplog.records] == [
        "engine at http://10.0.0.7:8000: weights go in buckets over tcp, served by the trainer on "
        "10.0.0.5 (a free port)",
        "engine at http://10.0.0.8:8000: weights go in buckets over nccl (process group backend gloo), served by "
        "the trainer on 10.0.0.5:29600",
        "engine at http://127.0.0.1:8001: weights go in buckets over shm",
        "engine at http://127.0.0.1:8002: weights go in buckets over the trainer device's default transport "
        "(shm on cpu, cuda_ipc on cuda)"]

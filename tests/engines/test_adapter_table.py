"""The OpenAI engine's adapter table: the alias follows the last committed version, a lease holds a
version against removal, and a retired version's name says which ones are live."""

from __future__ import annotations

import asyncio

from titan_lora.engines.adapter_table import AdapterTable, alias_of


def test_the_alias_is_the_name_without_its_version_suffix() -> None:
    assert alias_of("policy-v3", 3) == "policy"
    assert alias_of("my-v2-lora-v12", 12) == "my-v2-lora"
    assert alias_of("policy-v3", 4) is None
    assert alias_of("-v3", 3) is None


def test_the_alias_serves_the_last_commit_and_falls_back_when_it_is_retired() -> None:
    table = AdapterTable()
    table.add("policy-v1", 1, 11)
    table.add("policy-v2", 2, 12)
    assert table.resolve("policy").name == "policy-v2"
    assert table.resolve("policy-v1").lora_id == 11
    table.add("policy-v1", 1, 13)  # a resumed trainer re-sends an older step: it is the newest now
    assert table.resolve("policy").name == "policy-v1"
    assert table.remove("policy-v1").lora_id == 13
    assert table.resolve("policy").name == "policy-v2"
    assert table.aliases() == {"policy": "policy-v2"}
    assert table.resolve("other") is None


def test_a_leased_version_is_not_removed_until_its_request_ends() -> None:
    async def scenario() -> None:
        table = AdapterTable()
        table.add("policy-v1", 1, 1)
        async with table.lease("policy-v1"):
            assert table.in_flight() == {"policy-v1": 1}
            assert table.remove("policy-v1") is None
            assert not await table.wait_unused("policy-v1", 0.05)
        assert await table.wait_unused("policy-v1", 0.05)
        assert table.remove("policy-v1") is not None
        assert table.names() == {}

    asyncio.run(scenario())


def test_a_version_that_is_not_live_is_named_as_such() -> None:
    table = AdapterTable()
    table.add("policy-v4", 4, 1)
    table.add("policy-v5", 5, 2)
    why = table.not_served("policy-v3")
    assert "policy-v3" in why and "policy-v4, policy-v5" in why
    assert table.not_served("policy-vx") is None and table.not_served("unrelated") is None

"""`[engine] urls` and `replicas`: refused before anything is built, each message naming the fix."""

from __future__ import annotations

import pytest

from titan_lora.config import Engine, attached_urls, validate_engine


@pytest.mark.parametrize(("engine", "message"), [
    (Engine(replicas=0), r"replicas must be >= 1, got 0; start at least 1"),
    (Engine(url="http://a:1", urls=["http://b:1", "http://c:1"]), r"url and urls are both set"),
    (Engine(urls=["http://b:1", "http://c:1"], replicas=2), r"use one of them"),
    (Engine(urls=["b:1"]), r"'b:1' is not an engine address"),
    (Engine(urls=["http://b:1", "http://b:1"]), r"names \['http://b:1'\] more than once"),
    (Engine(port=65535, replicas=2), r"past 65535"),
])
def test_bad_replica_settings_are_refused(engine: Engine, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        validate_engine(engine)


def test_attached_urls() -> None:
    assert attached_urls(Engine()) == [], "nothing attached: titan_lora starts the engines"
    assert attached_urls(Engine(url="http://a:1")) == ["http://a:1"]
    assert attached_urls(Engine(urls=["http://a:1", "http://b:2"])) == ["http://a:1", "http://b:2"]
    validate_engine(Engine(replicas=3, port=9000))  # ports 9000-9002

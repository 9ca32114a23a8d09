"""The registry every plug-in point shares: lazy built-ins, registration once, `module:attribute` paths,
and errors that name the config key and the choices."""

from __future__ import annotations

import sys
import types

import pytest

from titan_lora.registry import Registry, load_object


def test_a_built_in_entry_is_imported_on_first_use_and_kept() -> None:
    reg: Registry = Registry("[x] kind", "kind", {"join": "os.path:join"})
    assert reg._entries["join"] == "os.path:join"
    import os.path

    assert reg.get("join") is os.path.join and reg._entries["join"] is os.path.join


def test_a_name_registers_once_and_is_listed() -> None:
    reg: Registry = Registry("[x] kind", "kind", {"b": "os:sep"})
    entry = object()
    assert reg.register("a", entry) is entry and reg.get("a") is entry and reg.names() == ["a", "b"]
    with pytest.raises(ValueError) as err:
        reg.register("a", object())
    assert str(err.value) == "kind 'a' is already registered"


def test_a_path_loads_without_registering_and_is_type_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("plug")
    module.GOOD, module.BAD = 3, "three"
    monkeypatch.setitem(sys.modules, "plug", module)
    reg: Registry = Registry("[x] kind", "kind", {}, accept=int)
    assert reg.get("plug:GOOD") == 3 and reg.names() == []
    with pytest.raises(ValueError) as err:
        reg.get("plug:BAD")
    assert str(err.value) == "[x] kind = 'plug:BAD': expected int, got str"


def test_errors_name_the_key_and_the_choices() -> None:
    reg: Registry = Registry("[x] kind", "kind", {"a": "os:sep"})
    with pytest.raises(ValueError) as err:
        reg.get("z")
    assert str(err.value) == "[x] kind = 'z' is not registered; known: a (or `package.module:attribute` for a plug-in)"
    with pytest.raises(ValueError, match=r"^\[x\] kind = 'nope:f': cannot load 'nope:f' \(No module named 'nope'\)$"):
        reg.get("nope:f")
    with pytest.raises(ValueError, match=r"^\[x\] kind = 'os:nope': cannot load 'os:nope' \(module 'os' has no"):
        reg.get("os:nope")
    with pytest.raises(ValueError, match=r"^what: cannot load ':x'"):
        load_object(":x", "what")

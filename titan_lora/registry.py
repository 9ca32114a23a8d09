"""The lazy registry behind the plug-ins a config names: model families, engine kinds, tasks, rewards.

Transports (`transfer/transports/`) and model converters (`titan/converters.py`) keep registries of their own.

Built-in entries are `module:attribute` strings imported on first use, so importing a registry imports
none of its entries. A config may also name any `package.module:attribute`, which needs no registration.
"""

from __future__ import annotations

import importlib
from typing import Generic, TypeVar

T = TypeVar("T")


def load_object(ref: str, what: str) -> object:
    """The attribute that `package.module:attribute` names; ValueError naming `what` if it cannot load."""
    module, _, attr = ref.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(f"{what}: cannot load {ref!r} ({err})") from None


class Registry(Generic[T]):
    """Name -> entry, for the config key `key` (e.g. "[engine] kind"); entries are checked by `accept`."""

    def __init__(self, key: str, noun: str, builtins: dict[str, str], accept: type | None = None) -> None:
        self.key, self.noun, self.accept = key, noun, accept
        self._entries: dict[str, T | str] = dict(builtins)

    def register(self, name: str, entry: T) -> T:
        """Add a plug-in under `name`; a name registers once."""
        if name in self._entries:
            raise ValueError(f"{self.noun} {name!r} is already registered")
        self._entries[name] = entry
        return entry

    def names(self) -> list[str]:
        """The names the config key accepts (besides `package.module:attribute`)."""
        return sorted(self._entries)

    def get(self, name: str) -> T:
        """The entry `name` selects: a registered name or `package.module:attribute`."""
        what = f"{self.key} = {name!r}"
        found = self._entries.get(name)
        if found is None and ":" not in name:
            raise ValueError(f"{what} is not registered; known: {', '.join(self.names())} "
                             "(or `package.module:attribute` for a plug-in)")
        if found is None or isinstance(found, str):
            found = load_object(found or name, what)
            if self.accept is not None and not isinstance(found, self.accept):
                raise ValueError(f"{what}: expected {self.accept.__name__}, got {type(found).__name__}")
            if name in self._entries:
                self._entries[name] = found
        return found

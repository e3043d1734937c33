"""``Registry``: the table behind each extension point (optimizers, samplers, recipes, model cards, instruction
formats): name -> entry in registration order, added once, looked up with a one-line error that lists the names."""

from __future__ import annotations

from typing import Generic, TypeVar

from .errors import SettingsError

V = TypeVar("V")


class Registry(dict, Generic[V]):
    """Name -> entry of one extension point, in registration order (the order ``--help`` lists and detection tries)."""

    def __init__(self, kind: str, error: type[Exception] = SettingsError):
        super().__init__()
        self.kind, self.error = kind, error

    def add(self, name: str, entry: V, replace: bool = False, first: bool = False) -> V:
        """Register ``entry`` under ``name`` (``replace`` to redefine it, ``first`` to put it before the others)."""
        if name in self and not replace:
            raise ValueError(f"a {self.kind} named {name!r} is registered already; pass replace=True to redefine it")
        rest = {k: v for k, v in self.items() if k != name}
        self.clear()
        self.update({name: entry, **rest} if first else {**rest, name: entry})
        return entry

    def remove(self, name: str) -> None:
        """Unregister ``name`` (nothing when it is not there)."""
        self.pop(name, None)

    def lookup(self, name: str) -> V:
        """The entry of ``name``, or one line naming the registered ones."""
        try:
            return self[name]
        except KeyError:
            raise self.error(f"{self.kind}={name!r}; choose one of {', '.join(self)}") from None


__all__ = ["Registry"]

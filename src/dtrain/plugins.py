"""Classes found by name: strategies (``dtrain.sync.registry``) and the doctor's factors
(``dtrain.explain.factors.registry``) each keep one :class:`Plugins`. A built-in registers itself when its
module is imported, and the built-in modules are imported on first lookup, so ``dtrain --help`` stays fast;
anyone else's class registers the same way and is listed after the built-ins."""

from __future__ import annotations

import importlib
from typing import Any, Generic, TypeVar

C = TypeVar("C", bound="type[Any]")


class Plugins(Generic[C]):
    """Classes by their ``name`` attribute; ``builtin_modules`` in the order names are listed."""

    def __init__(self, builtin_modules: tuple[str, ...]) -> None:
        self.builtin_modules = builtin_modules
        self._classes: dict[str, C] = {}
        self._loaded = False

    def register(self, cls: C) -> C:
        """Class decorator: ``cls`` under ``cls.name``."""
        self._classes[cls.name] = cls
        return cls

    def unregister(self, name: str) -> None:
        self._classes.pop(name, None)

    def classes(self) -> dict[str, C]:
        """Every registered class by name, the built-in modules imported first."""
        if not self._loaded:
            self._loaded = True
            for module in self.builtin_modules:
                importlib.import_module(module)
        return self._classes

    def ordered(self) -> list[str]:
        """Every registered name: built-ins in their modules' order, then the others as registered."""
        classes = self.classes()

        def order(name: str) -> int:
            module = classes[name].__module__
            return self.builtin_modules.index(module) if module in self.builtin_modules else len(self.builtin_modules)

        return sorted(classes, key=order)

"""Package exports loaded on first use (PEP 562 module ``__getattr__``).

A package lists ``{name: module}`` and gets the ``__getattr__`` / ``__dir__`` pair
that imports a name's module only when the name is first looked up, then keeps the
name in the package's globals so later lookups are plain attribute reads. Importing
the package itself loads none of the modules (no Triton, no optional library).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping


def lazy_exports(package: str, exports: Mapping[str, str],
                 namespace: dict[str, Any]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """(``__getattr__``, ``__dir__``) for ``package`` (its ``__name__``), whose
    ``exports`` maps each public name to its module, relative to the package (``"layer"``
    or ``".layer"``, ``"..staging.view"``); ``namespace`` is the package's ``globals()``."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module if module.startswith(".") else f".{module}", package), name)
        namespace[name] = value  # later lookups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__


__all__ = ["lazy_exports"]

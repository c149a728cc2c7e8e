"""The subclasses this package makes of a backbone's own modules, in one registry.

A mixin (the dual view's attention and MLP, exact mode's linear layers, norms, decoder layers and stack) goes
over the module's own Hugging Face class as a subclass made once per (mixin, class), and the instance's class is
swapped to it: the module keeps its parameters, buffers and hooks, and stays an instance of its own class. The
dual view and exact mode both swap through here, so a module can carry both mixins and each is made once.
It knows no mixin and no model.
"""

from __future__ import annotations

_MADE: dict[tuple[type, type], type] = {}


def mixed_class(mixin: type, base: type, name: str | None = None, namespace: dict | None = None) -> type:
    """The class `(mixin, base)`, made on first use: named `name` (default: the mixin's name without `Mixin`,
    then the base's), with `namespace`'s attributes."""
    if (mixin, base) not in _MADE:
        _MADE[(mixin, base)] = type(name or f"{mixin.__name__.removesuffix('Mixin')}{base.__name__}", (mixin, base),
                                    dict(namespace or {}))
    return _MADE[(mixin, base)]


def swap_class(module, mixin: type, name: str | None = None, namespace: dict | None = None) -> None:
    """Give `module` the mixin (nothing where it has it already)."""
    if not isinstance(module, mixin):
        module.__class__ = mixed_class(mixin, type(module), name, namespace)

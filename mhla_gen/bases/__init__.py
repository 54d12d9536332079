"""The base model families mhla_gen supports, one record each (:class:`Base`), and the lookups.

Add a base: write ``bases/<name>.py`` with its ``BASE`` record and list it in :data:`BASES` below
(``docs/extending.md``). Everything else asks the record: :func:`base_for` (a name from a config or a
flag), :func:`base_for_model` (a transformer instance), :func:`base_for_class_name` (a ``config.json``).
"""

from __future__ import annotations

from torch import nn

from . import dit, sana, sana_video, wan, wan_i2v
from .record import Base, Ref, TokenGrid

RECORDS = (dit.BASE, sana.BASE, wan_i2v.BASE, wan.BASE, sana_video.BASE)  # more specific records first
BASES: dict[str, Base] = {base.name: base for base in RECORDS}
"""Every supported base, by name; where several share a transformer class, the first listed that
``matches`` a model's config answers for it."""


def base_for(name: str) -> Base:
    """The record named ``name``; ValueError listing the names otherwise."""
    if name not in BASES:
        raise ValueError(f"unknown base {name!r}; supported bases: {sorted(BASES)}")
    return BASES[name]


def _supported() -> list[str]:
    return sorted({base.transformer_class.__name__ for base in BASES.values()})


def base_for_model(transformer: nn.Module) -> Base:
    """The record of a transformer instance (its class, or a subclass of it, and its config)."""
    for base in BASES.values():
        if isinstance(transformer, base.transformer_class) and base.matches(dict(transformer.config)):
            return base
    raise ValueError(f"MHLA does not support {type(transformer).__name__}; supported models: {_supported()}")


def _class_names(cls: type) -> set[str]:
    """``cls``'s name and those of its subclasses defined so far (a transformer subclass registered for
    diffusers loading names itself in ``config.json``)."""
    return {cls.__name__}.union(*(_class_names(sub) for sub in cls.__subclasses__()))


def base_for_class_name(class_name: str, config: dict | None = None) -> Base:
    """The record for a diffusers class name, as written in ``config.json["_class_name"]`` (``config``:
    the rest of that file, for records that share a class)."""
    for base in BASES.values():
        if class_name in _class_names(base.transformer_class) and base.matches(config or {}):
            return base
    raise ValueError(f"MHLA does not support model class {class_name!r}; supported models: {_supported()}")


__all__ = ["BASES", "Base", "Ref", "TokenGrid", "base_for", "base_for_class_name", "base_for_model"]

"""How the readers key a model's routers: by 0-based layer index, or by (layer, part) where a
layer holds several routers (:mod:`.records` builds the keys, :mod:`.plan` and :mod:`.metrics`
print them).

A layer's only router is keyed by its index (an ``int``: Megatron, and most transformers
families). Where some layer holds several (ERNIE-4.5-VL's text and vision routers,
DiffusionGemma's encoder and decoder stacks), every router of the model is keyed by a
:class:`RouterKey`, so that the keys of one model always sort together.
"""

from __future__ import annotations

from typing import NamedTuple


class RouterKey(NamedTuple):
    """A router's layer index and its part (``"text_moe"``, ``"vision_moe"``; ``""`` for a layer's
    only router). Printed ``3.vision_moe`` (metric names: ``elastic_moe/layer_3.vision_moe/...``)."""

    layer: int
    part: str

    def __str__(self) -> str:
        return f"{self.layer}.{self.part}" if self.part else str(self.layer)

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


#: a router's key in the readers' dicts
LayerKey = int | RouterKey


def layer_of(key: LayerKey) -> int:
    """The 0-based layer index of a key."""
    return key if isinstance(key, int) else key.layer


def part_of(key: LayerKey) -> str:
    """The part of a key (``""`` for a plain layer index)."""
    return "" if isinstance(key, int) else key.part


__all__ = ["LayerKey", "RouterKey", "layer_of", "part_of"]

"""Which layers of a Megatron ``HybridModel`` hold a router, read off its layer pattern.

A hybrid layer pattern (``--hybrid-layer-pattern``, ``HybridModel(hybrid_layer_pattern=...)``)
spells the decoder one symbol per layer: ``*`` attention, ``E`` MoE, ``-`` MLP, ``M`` Mamba (and
Megatron's other mixers), ``|`` a pipeline-stage boundary (no layer), and after the first ``/`` the
multi-token-prediction layers, which are not decoder layers. Every symbol is a layer of its own:
``HybridStack`` gives the ``i``-th symbol (pipes skipped) ``layer_number = i + 1``, which is the
``i`` of ``decoder.layers.{i}`` in the checkpoint and what ``ElasticConfig.layers`` selects. So in
``*E*E*E*E`` the MoE layers are 1, 3, 5 and 7, and a model-wide mean of a routing metric divides
by 4, not 8.

Plain string work, no megatron import: the Megatron-LM entry point reads the pattern before
Megatron starts (:mod:`.megatron_args`), and the metrics read it from the arguments or the model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

PIPE = "|"
MTP_SEPARATOR = "/"
MOE = "E"
#: the symbols of megatron-core 0.19's ``Symbols.VALID_LAYERS`` (a symbol outside it is Megatron's to refuse)
LAYER_SYMBOLS = frozenset("MG*D+-E")


@dataclasses.dataclass(frozen=True)
class HybridLayers:
    """The decoder layers a hybrid pattern spells.

    Attributes:
        symbols: one symbol per decoder layer, in layer order (pipes and MTP removed).
        moe_layers: the 0-based layer numbers of the ``E`` symbols; their position in this tuple is
            the layer's MoE index.
        stages: the pattern's pipeline segments (``|``-separated), each a run of symbols.
    """

    symbols: str
    moe_layers: tuple[int, ...]
    stages: tuple[str, ...]

    @property
    def num_layers(self) -> int:
        return len(self.symbols)

    def moe_index(self, layer: int) -> int | None:
        """The MoE index of the 0-based ``layer`` (its rank among the MoE layers), None if it is no MoE layer."""
        try:
            return self.moe_layers.index(layer)
        except ValueError:
            return None

    def describe_moe_layers(self) -> str:
        """``"1, 3, 5, 7 (of *E*E*E*E)"``: the MoE layer numbers, for messages."""
        numbers = ", ".join(str(layer) for layer in self.moe_layers) or "none"
        return f"{numbers} (of {self.symbols})"


def parse(pattern: str) -> HybridLayers | None:
    """The decoder layers of ``pattern``; None where it is not a pattern this module reads (empty,
    or a symbol outside :data:`LAYER_SYMBOLS`: Megatron's own parser refuses it with its message)."""
    if not isinstance(pattern, str):
        return None
    decoder = pattern.split(MTP_SEPARATOR, 1)[0]
    stages = tuple(decoder.split(PIPE))
    symbols = "".join(stages)
    if not symbols or not set(symbols) <= LAYER_SYMBOLS:
        return None
    moe_layers = tuple(index for index, symbol in enumerate(symbols) if symbol == MOE)
    return HybridLayers(symbols, moe_layers, stages)


def pattern_of(options: Any) -> str | None:
    """The hybrid pattern of Megatron-LM's arguments or of a namespace of its flags:
    ``hybrid_layer_pattern``, else the deprecated ``hybrid_override_pattern``; None for a GPT model."""
    for name in ("hybrid_layer_pattern", "hybrid_override_pattern"):
        pattern = getattr(options, name, None)
        if isinstance(pattern, str) and pattern:
            return pattern
    return None


def moe_layer_numbers(num_layers: int, moe_layer_freq: Any = 1, pattern: str | None = None) -> tuple[int, ...]:
    """The 0-based layer numbers that hold a router: the ``E`` symbols of a hybrid ``pattern``, else
    (a GPT decoder) every ``moe_layer_freq``-th of ``num_layers`` (an int), or the layers a 0/1
    list marks. The one rule behind the metrics' layer mean and the plan line's MoE index."""
    hybrid = parse(pattern) if pattern else None
    if hybrid is not None:
        return hybrid.moe_layers
    if isinstance(moe_layer_freq, int):
        return tuple(layer for layer in range(num_layers) if layer % moe_layer_freq == 0)
    return tuple(layer for layer, is_moe in enumerate(moe_layer_freq) if is_moe)


def pattern_of_modules(modules: Iterable[Any]) -> str | None:
    """The ``hybrid_layer_pattern`` of the first ``HybridModel`` among ``modules`` (e.g. every
    submodule of the model chunks, wrappers included), None when there is none."""
    for module in modules:
        pattern = getattr(module, "hybrid_layer_pattern", None)
        if isinstance(pattern, str) and pattern:
            return pattern
    return None


__all__ = [
    "LAYER_SYMBOLS",
    "MOE",
    "MTP_SEPARATOR",
    "PIPE",
    "HybridLayers",
    "moe_layer_numbers",
    "parse",
    "pattern_of",
    "pattern_of_modules",
]

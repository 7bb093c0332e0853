"""megatron-core 0.19's ``HybridModel`` on the CPU: a local (non-Transformer-Engine) stack spec, and
the stack's final norm.

* :data:`hybrid_stack_spec`: the ``HybridStack`` spec Megatron's own (``hybrid_layer_specs``) spells
  with Transformer Engine modules, spelled with megatron-core's local ones, as
  ``get_gpt_layer_local_spec`` does for a GPT layer. Per pattern symbol:

  - ``*`` attention: ``TransformerLayer`` with ``input_layernorm`` (the torch norm) and
    ``SelfAttention`` (``ColumnParallelLinear`` qkv, ``DotProductAttention``, ``RowParallelLinear``);
  - ``-`` MLP: ``MLPLayer`` with ``pre_mlp_layernorm`` and the local ``MLP``;
  - ``E`` MoE: ``MoETransformerLayer`` with ``pre_mlp_layernorm`` and the MoE spec of
    ``get_moe_module_spec(use_te=False)``: ``SequentialMLP`` experts, local linears;
  - ``M`` Mamba: only where ``mamba_ssm`` imports (Megatron's ``MambaMixer`` needs its triton
    kernels, so never on a CPU-only machine, and this branch is untested here): ``MambaLayer`` with
    the torch norm and a ``MambaMixer`` of local linears.

  The norm is ``WrappedTorchNorm`` (LayerNorm or RMSNorm from ``config.normalization``), which the
  runtime makes usable with sequence parallelism (:mod:`.megatron_core`). Where the TE spec fuses the
  norm into the next linear (attention's ``linear_qkv``, the MLP's ``linear_fc1``), the layers map
  their checkpoint keys to the fused names, as the local GPT spec does, so checkpoints keep TE's keys.
  The stack is a subclass of ``HybridStack`` that only adds a check first: a pattern with a symbol
  this spec does not build (``M`` without ``mamba_ssm``; ``G``, ``D``, ``+``, which the stock stack
  would silently build as identity layers) is refused before any layer is built, naming the symbol,
  the pattern (this pipeline stage's part) and the symbols supported. No MTP block: a pattern
  with ``/`` is refused by ``HybridModel`` ("mtp_block_spec is None").

  Used by Megatron-LM as ``--spec elastic_moe_plugin.cpu_runtime.hybrid hybrid_stack_spec``, which
  ``python -m elastic_moe_plugin.megatron_lm --cpu`` adds to a ``--hybrid-layer-pattern`` run without
  ``--spec``; or directly: ``HybridModel(config, hybrid_stack_spec=hybrid.hybrid_stack_spec, ...)``.
  Built lazily (importing this module imports no megatron): on first access, and when
  ``megatron.core.models.hybrid.hybrid_block`` is imported under the runtime, so that Megatron's
  ``import_module`` (which reads the module's ``vars()``) finds it.

* ``megatron.core.models.hybrid.hybrid_block.TENorm`` -> ``WrappedTorchNorm`` (installed by every
  ``cpu_runtime.enable()``, restored by identity on ``disable()``). ``HybridStack`` builds its final
  norm with the ``TENorm`` that module imported, whatever the spec says; without Transformer Engine
  that class raises ImportError, so no hybrid model could be built on the CPU. ``TENorm`` is called
  there with ``config``, ``hidden_size`` and ``eps``, which the torch norm takes alike.
"""

from __future__ import annotations

import functools
import types
from typing import Any

from elastic_moe_plugin.core.patching import AttributePatches
from elastic_moe_plugin.cpu_runtime.errors import MegatronCPUError

HYBRID_BLOCK_MODULE = "megatron.core.models.hybrid.hybrid_block"
#: the spec's dotted location, as Megatron-LM's ``--spec`` takes it (two words)
SPEC_ARGUMENT = (__name__, "hybrid_stack_spec")
#: the pattern symbols this spec always builds, with their meaning
SUPPORTED_SYMBOLS = {"*": "attention", "-": "MLP", "E": "MoE"}
MAMBA_SYMBOL = "M"
#: Megatron's other layer symbols, none of which this spec builds
UNSUPPORTED_SYMBOLS = {"G": "gated delta net", "D": "DeepSeek sparse attention", "+": "multi-latent attention"}


def _torch_norm() -> type:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return WrappedTorchNorm


def _have_mamba_ssm() -> bool:
    """Megatron's own answer: its Mamba mixer imported ``mamba_ssm``'s kernels."""
    from megatron.core.ssm import mamba_mixer

    return bool(mamba_mixer.HAVE_MAMBA_SSM)


def supported_symbols() -> dict[str, str]:
    """The pattern symbols :data:`hybrid_stack_spec` builds here: ``*``, ``-``, ``E``, and ``M``
    where ``mamba_ssm`` imports."""
    return {**SUPPORTED_SYMBOLS, **({MAMBA_SYMBOL: "Mamba"} if _have_mamba_ssm() else {})}


def check_layer_symbols(layer_type_list: list[str], pp_layer_offset: int = 0) -> None:
    """Refuse a pattern with a symbol the CPU spec does not build.

    Args:
        layer_type_list: this pipeline stage's layer symbols, as ``HybridModel`` hands them to
            ``HybridStack`` (one symbol per layer).
        pp_layer_offset: the 0-based number of this stage's first layer.

    Raises:
        MegatronCPUError: naming the first unsupported symbol, its layer number, the pattern and the
            supported symbols.
    """
    supported = supported_symbols()
    for index, symbol in enumerate(layer_type_list):
        if symbol in supported:
            continue
        meaning = {**UNSUPPORTED_SYMBOLS, MAMBA_SYMBOL: "Mamba"}.get(symbol, "unknown")
        reason = " (Megatron's MambaMixer needs the mamba_ssm package, not importable here)"
        reason = reason if symbol == MAMBA_SYMBOL else ""
        offered = ", ".join(f"'{s}' {name}" for s, name in supported.items())
        raise MegatronCPUError(
            f"hybrid layer pattern {''.join(layer_type_list)!r}: symbol {symbol!r} ({meaning}) at layer "
            f"{pp_layer_offset + index} is not built by the CPU spec {'.'.join(SPEC_ARGUMENT)}{reason}. "
            f"It builds {offered}; use a pattern of those, or a spec of your own (--spec MODULE NAME)."
        )


def _checked_stack_class() -> type:
    from megatron.core.models.hybrid.hybrid_block import HybridStack

    class CPUHybridStack(HybridStack):
        """``HybridStack``, refusing up front a pattern symbol the CPU spec does not build
        (:func:`check_layer_symbols`); otherwise the stock class, unchanged."""

        def __init__(self, config: Any, submodules: Any, *args: Any, **kwargs: Any) -> None:
            check_layer_symbols(list(kwargs.get("layer_type_list") or []), int(kwargs.get("pp_layer_offset", 0)))
            super().__init__(config, submodules, *args, **kwargs)

    CPUHybridStack.__module__, CPUHybridStack.__qualname__ = __name__, "CPUHybridStack"
    return CPUHybridStack


def _attention_layer(norm: type) -> Any:
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    attention = ModuleSpec(
        module=SelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=ColumnParallelLinear, core_attention=DotProductAttention, linear_proj=RowParallelLinear
        ),
    )
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=attention,
            self_attn_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map={"input_layernorm.": "self_attention.linear_qkv.layer_norm_"},
        ),
    )


def _mlp_layer(norm: type) -> Any:
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

    return ModuleSpec(
        module=MLPLayer,
        submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=norm,
            mlp=functools.partial(
                MLP.as_mlp_submodule,
                submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
            ),
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map={"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"},
        ),
    )


def _moe_layer(norm: type) -> Any:
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import MoETransformerLayer, TransformerLayerSubmodules

    # the expert count only has to be set: the experts are built from config.num_moe_experts
    moe = get_moe_module_spec(use_te=False, num_experts=1, moe_grouped_gemm=False)
    return ModuleSpec(
        module=MoETransformerLayer,
        submodules=TransformerLayerSubmodules(pre_mlp_layernorm=norm, mlp=moe, mlp_bda=get_bias_dropout_add),
    )


def _mamba_layer(norm: type) -> Any:
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec

    mixer = ModuleSpec(
        module=MambaMixer,
        submodules=MambaMixerSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear),
    )
    return ModuleSpec(
        module=MambaLayer,
        submodules=MambaLayerSubmodules(
            norm=norm,
            mixer=mixer,
            mamba_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map={"norm.": "mixer.in_proj.layer_norm_"},
        ),
    )


@functools.lru_cache(maxsize=1)
def build_hybrid_stack_spec() -> Any:
    """The ``ModuleSpec`` of :data:`hybrid_stack_spec` (module docstring), built once."""
    from megatron.core.models.hybrid.hybrid_block import HybridStackSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    norm = _torch_norm()
    layers = dict(attention_layer=_attention_layer(norm), mlp_layer=_mlp_layer(norm), moe_layer=_moe_layer(norm))
    if _have_mamba_ssm():
        layers["mamba_layer"] = _mamba_layer(norm)
    return ModuleSpec(module=_checked_stack_class(), submodules=HybridStackSubmodules(**layers))


def __getattr__(name: str) -> Any:
    if name == "hybrid_stack_spec":
        spec = build_hybrid_stack_spec()
        globals()[name] = spec  # from now on a plain attribute, visible to vars()
        return spec
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _fix_hybrid_block(patches: AttributePatches, module: types.ModuleType) -> None:
    if getattr(module, "TENorm", None) is not None:
        patches.set(module, "TENorm", _torch_norm())
    __getattr__("hybrid_stack_spec")  # Megatron-LM's --spec reads vars(this module)


def install(patches: AttributePatches) -> None:
    """The final-norm redirection (module docstring), now or when ``hybrid_block`` is imported."""
    patches.when_imported(HYBRID_BLOCK_MODULE, functools.partial(_fix_hybrid_block, patches))


__all__ = [
    "HYBRID_BLOCK_MODULE",
    "SPEC_ARGUMENT",
    "build_hybrid_stack_spec",
    "check_layer_symbols",
    "install",
    "supported_symbols",
]

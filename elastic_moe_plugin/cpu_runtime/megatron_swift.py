"""Megatron-SWIFT (``megatron sft``, ms-swift 4.6) on a CPU-only torch: what mcore-bridge needs.

Megatron-SWIFT builds a Megatron-core GPT from a Hugging Face checkpoint through mcore-bridge
(1.6.x), converts the weights into it, trains with megatron-core's optimizer and converts them back
when it saves in HF format. On a CPU-only torch, beyond what :mod:`.runtime` redirects
(``enable(training=True)``), four things stop it; each is answered here, scoped so that
megatron-core sees exactly what it sees without Transformer Engine (verified against mcore-bridge
1.6.5 on megatron-core 0.19.2 and 0.16.1):

1. **``import transformer_engine`` in mcore-bridge.** ``mcore_bridge/__init__`` calls
   ``apply_patch()``, whose ``_patch_transformer_engine`` imports it; ``tuners/lora.py``,
   ``model/modules/{mtp_layer,gated_delta_net,compressor,dsa_indexer}.py`` and
   ``model/gpts/deepseek_v4.py`` import it in their module bodies. A stand-in package answers those
   imports, and *only* those: it is importable while the innermost executing module body belongs
   to ``mcore_bridge`` and the importing frame is mcore-bridge code; it is removed from
   ``sys.modules`` whenever another module's body runs (megatron-core imported by mcore-bridge
   included) and when the outermost mcore-bridge body returns. About 30 megatron-core modules probe
   ``import transformer_engine`` to set ``HAVE_TE``; none of them can see it, so ``HAVE_TE`` stays
   False everywhere in megatron-core. Any attribute of the stand-in raises ``AttributeError``
   (mcore-bridge's TE patches catch it and log "Failed to patch ...", which is true here).
2. **TE classes that megatron-core binds to ``None`` / ``MagicMock()`` without TE.** mcore-bridge
   imports ``TEGroupedLinear``, ``TELinear``, ``TELayerNormColumnParallelLinear`` and others from
   ``megatron.core.extensions.transformer_engine`` and then assigns
   ``TEGroupedLinear.sharded_state_dict`` (``patcher._patch_TEGroupedLinear``: fails on ``None``)
   and calls ``isinstance(module, TELinear)`` (``model/register.py``, ``tuners/lora.py``: fails on a
   mock). In each mcore-bridge module, right after its body ran, every such name (starting with
   ``TE``, bound to the same ``None``/mock as megatron-core's module attribute) is rebound *in that
   mcore-bridge module* to a class that raises :class:`~elastic_moe_plugin.cpu_runtime.MegatronCPUError`
   when instantiated. megatron-core's own attributes are left alone.
3. **``import triton``, unguarded,** at the top of
   ``mcore_bridge/model/modules/kernels/qsa_block_sparse_attn.py`` (imported by every model through
   ``model/modules/kernels/__init__``) and, on megatron-core 0.16, of
   ``megatron/core/inference/contexts/attention_context/triton/tensor_ops.py`` (imported by
   ``megatron.core.ssm.mamba_mixer``, which mcore-bridge's ``model/gpts/nemotron_h.py`` imports;
   0.19 guards it). Where the module's body fails on ``import triton``, the module is completed with
   its importable names (:data:`TRITON_ONLY_MODULES`) as functions that raise if called: QSA sparse
   attention and Mamba inference only, neither on the path of a Qwen3-MoE/OLMoE model.
4. **The layer spec and the weight layout.** ``ModelLoader.get_transformer_layer_spec`` and
   ``get_mtp_block_spec`` (``model/register.py``) call megatron-core's
   ``get_gpt_decoder_block_spec`` / ``get_gpt_mtp_block_spec`` with ``use_transformer_engine=True``,
   i.e. ``TESpecProvider()``, whose classes do not exist here. Those two names in
   ``mcore_bridge.model.register`` are wrapped to pass ``use_transformer_engine=False``: megatron-core's
   local spec (torch norms, ``ColumnParallelLinear``/``RowParallelLinear``, ``SequentialMLP`` experts;
   megatron-core's local backend has no grouped-GEMM experts). The weight converter
   (``bridge/gpt_bridge.GPTBridge``) then needs two layouts of that spec:

   - the norms are modules of their own: ``self_attention.linear_qkv.layer_norm_weight`` (TE fuses
     the input norm into the QKV linear) is ``input_layernorm.weight``, and
     ``mlp.linear_fc1.layer_norm_weight`` is ``pre_mlp_layernorm.weight``
     (``GPTBridge._set_state_dict`` translates the two keys);
   - ``SequentialMLP`` holds expert ``i`` as ``local_experts.i.linear_fc1.weight`` (``[2F, H]``,
     gate rows then up rows, as TE's ``linear_fc1.weight{i}``), while ``GPTBridge._set_mlp_state``
     reads only the grouped layout ``linear_fc1.weight{i}``. It is handed a view of the
     ``SequentialMLP`` with that layout (:class:`GroupedExpertsView`), whose ``weight{i}`` *are*
     the experts' parameters, so loading copies into and saving reads from the real weights.

Plus megatron-core's gradient clipping on host tensors (:mod:`.grad_clip`), so runs keep the
recipes' ``clip_grad`` and log a real ``grad_norm``.

Flags a CPU run of ``megatron sft`` passes itself (choices of the run, not redirected; see
:data:`CPU_FLAGS`): ``--torch_dtype float32 --bf16 false --fp16 false`` (no bf16 GEMMs worth using on
CPU), ``--attention_backend local`` (no flash attention), ``--moe_grouped_gemm false`` (no grouped
GEMM on CPU; the local spec builds ``SequentialMLP`` anyway), ``--moe_permute_fusion false``,
``--use_distributed_optimizer false``, ``--padding_free false`` and ``--packing false`` (packed
THD attention needs TE/flash), ``--cross_entropy_loss_fusion false``, ``--ddp_backend gloo`` (read by
Megatron-SWIFT's distributed initialisation), and ``--megatron_extra_kwargs
'{"persist_layer_norm": false}'`` (the persistent LayerNorm kernel is apex/CUDA).

Usage: :func:`enable` before ``mcore_bridge`` is imported, in every process of the run (``megatron
sft`` re-launches itself, and torchrun starts one process per rank): the child bootstrap
``elastic_moe_plugin.tools.child_bootstrap`` (on the children's ``PYTHONPATH`` with
``EMOE_BOOTSTRAP=megatron_swift``) calls it in each, for the rehearsal, the bench and the tests.
Explicit and opt-in: nothing in a GPU run imports this module, and :func:`enable` refuses to run
where CUDA is available (``force=True`` in tests only).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

from elastic_moe_plugin.core.import_hooks import IMPORT_HOOKS, Hook, importing_module
from elastic_moe_plugin.core.patching import AttributePatches, PatchSwitch

__all__ = [
    "CPU_FLAGS",
    "MAMBA_TENSOR_OPS_MODULE",
    "MCORE_BRIDGE",
    "QSA_KERNEL_MODULE",
    "TE_PACKAGE",
    "TRITON_ONLY_MODULES",
    "GroupedExpertsView",
    "TransformerEngineAbsent",
    "disable",
    "enable",
    "is_enabled",
    "served_stand_ins",
    "te_stand_in_visible",
]

MCORE_BRIDGE = "mcore_bridge"
TE_PACKAGE = "transformer_engine"
TE_EXTENSIONS = "megatron.core.extensions.transformer_engine"
QSA_KERNEL_MODULE = "mcore_bridge.model.modules.kernels.qsa_block_sparse_attn"
#: megatron-core 0.16's mamba tensor ops (``import triton`` unguarded; 0.19 guards it), imported by
#: ``megatron.core.ssm.mamba_mixer``, which mcore-bridge's ``model/gpts/nemotron_h.py`` imports
MAMBA_TENSOR_OPS_MODULE = "megatron.core.inference.contexts.attention_context.triton.tensor_ops"
#: modules whose body imports triton unconditionally -> the functions other modules import from them
TRITON_ONLY_MODULES: dict[str, tuple[str, ...]] = {
    QSA_KERNEL_MODULE: ("qsa_sparse_attention_from_indices",),
    MAMBA_TENSOR_OPS_MODULE: ("tensor_get_slice_after", "tensor_merge", "tensor_masked_update"),
}
_REGISTER_MODULE = "mcore_bridge.model.register"
_BRIDGE_MODULE = "mcore_bridge.bridge.gpt_bridge"

#: ``megatron sft`` flags of a CPU run (flag -> value, in ms-swift's spelling), with the reason
CPU_FLAGS: dict[str, tuple[str, str]] = {
    "torch_dtype": ("float32", "bf16 weights: GPU numerics; float32 on CPU"),
    "bf16": ("false", "bf16 mixed precision is a GPU choice"),
    "fp16": ("false", "fp16 mixed precision is a GPU choice"),
    "attention_backend": ("local", "flash attention is GPU-only"),
    "moe_grouped_gemm": (
        "false",
        "grouped GEMM kernels are GPU-only (megatron-core's local spec builds SequentialMLP)",
    ),
    "moe_permute_fusion": ("false", "fused permute needs Transformer Engine"),
    "use_distributed_optimizer": ("false", "the distributed optimizer's buffers need CUDA"),
    "padding_free": ("false", "padding-free (THD) attention needs Transformer Engine or flash attention"),
    "packing": ("false", "packing needs padding-free attention"),
    "cross_entropy_loss_fusion": ("false", "the fused cross entropy is a CUDA kernel"),
    "ddp_backend": ("gloo", "NCCL is GPU-only"),
    "megatron_extra_kwargs": ('{"persist_layer_norm": false}', "the persistent LayerNorm kernel is apex/CUDA"),
}


# ------------------------------ 2. TE classes as they must look to mcore-bridge
class TransformerEngineAbsent:
    """Base of the classes that stand in, inside mcore-bridge's modules, for the TE classes
    megatron-core binds to ``None``/``MagicMock()`` without Transformer Engine. ``isinstance`` and
    class attributes work; instantiating one raises."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from elastic_moe_plugin.cpu_runtime import MegatronCPUError

        raise MegatronCPUError(
            f"{type(self).__name__} is a Transformer Engine class, and Transformer Engine is not installed: "
            "elastic_moe_plugin.cpu_runtime.megatron_swift builds megatron-core's local layer spec instead. "
            "Something asked for a TE module explicitly (a TE-only model or option); run it on a GPU with "
            "Transformer Engine, without the CPU runtime."
        )


_PLACEHOLDERS: dict[str, type] = {}


def _placeholder(name: str) -> type:
    """One class per TE name, shared by every mcore-bridge module (so ``isinstance`` agrees)."""
    if name not in _PLACEHOLDERS:
        _PLACEHOLDERS[name] = type(
            name,
            (TransformerEngineAbsent,),
            {"__module__": __name__, "__doc__": f"CPU-runtime stand-in for {TE_EXTENSIONS}.{name}."},
        )
    return _PLACEHOLDERS[name]


def _is_absent_te_value(value: Any) -> bool:
    return value is None or isinstance(value, mock.NonCallableMock)


# ------------------------------ 1. and 3. The import scope: TE stand-in for mcore-bridge bodies, triton-only modules
class _TEStandIn(types.ModuleType):
    """``transformer_engine`` (or a submodule) as mcore-bridge's module bodies may import it."""

    __cpu_runtime_stand_in__ = True

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(
            f"{self.__name__}.{name}: Transformer Engine is not installed; this module is a stand-in of "
            "elastic_moe_plugin.cpu_runtime.megatron_swift, importable only by mcore-bridge's module bodies."
        )


class _TritonKernelAbsent:
    """A function of a triton-only module, as a CPU stand-in: importable, raises if called."""

    def __init__(self, module: str, name: str) -> None:
        self.__name__ = name
        self.__qualname__ = name
        self._module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from elastic_moe_plugin.cpu_runtime import MegatronCPUError

        raise MegatronCPUError(
            f"{self._module}.{self.__name__} is a stand-in of elastic_moe_plugin.cpu_runtime.megatron_swift; the "
            "real kernel needs triton and a GPU (run on a GPU without the CPU runtime)."
        )

    def __repr__(self) -> str:
        return f"<unavailable triton kernel {self._module}.{self.__name__} (cpu_runtime stand-in)>"


class _BodyStack(threading.local):
    def __init__(self) -> None:
        self.bridge: list[bool] = []  # per executing module body: is it mcore-bridge's?


def _is_bridge_name(name: str) -> bool:
    return name == MCORE_BRIDGE or name.startswith(MCORE_BRIDGE + ".")


def _is_te_name(name: str) -> bool:
    return name == TE_PACKAGE or name.startswith(TE_PACKAGE + ".")


class _BridgeImportScope:
    """The import scope, as two hooks on the package's one import finder
    (:data:`~elastic_moe_plugin.core.import_hooks.IMPORT_HOOKS`):

    - around the body of every mcore-bridge module, every :data:`TRITON_ONLY_MODULES` module and
      every module imported while an mcore-bridge body is innermost (:meth:`_body`): which body is
      executing, for (1); the completion of a triton-only module, for (3); and the fix of each
      mcore-bridge module right after its body (``after_bridge_body``), for (2) and (4);
    - a provider of ``transformer_engine`` (and its submodules) that serves the stand-in only to an
      ``import`` run by mcore-bridge code while an mcore-bridge body is innermost, for (1): anything
      else gets ``ModuleNotFoundError``, exactly as without Transformer Engine.
    """

    def __init__(self, after_bridge_body: Callable[[types.ModuleType], None]) -> None:
        self._after_bridge_body = after_bridge_body
        self._stack = _BodyStack()
        self._lock = threading.RLock()
        self._hooks: list[Hook] = []
        self.te_modules: dict[str, _TEStandIn] = {}
        self.served: list[str] = []  # names of stand-ins handed out, for the tests

    def install(self) -> None:
        # TE names are never tracked as bodies: the stand-in has none, and a real TE is not ours
        self._hooks = [
            IMPORT_HOOKS.serve(self._serves_te, self._te_module),
            IMPORT_HOOKS.around_bodies(
                lambda name: (
                    not _is_te_name(name)
                    and (_is_bridge_name(name) or name in TRITON_ONLY_MODULES or self.bridge_body_on_top())
                ),
                self._body,
            ),
        ]

    def uninstall(self) -> None:
        for hook in self._hooks:
            hook.cancel()
        self._hooks = []
        self.remove_stand_ins()

    # ------------------------------------------------------------------ visibility
    def bridge_body_on_top(self) -> bool:
        stack = self._stack.bridge
        return bool(stack) and stack[-1]

    def _sync(self) -> None:
        """TE stand-ins are in ``sys.modules`` exactly while an mcore-bridge body is innermost."""
        visible = self.bridge_body_on_top()
        with self._lock:
            for name, module in self.te_modules.items():
                if visible:
                    sys.modules.setdefault(name, module)
                elif sys.modules.get(name) is module:
                    del sys.modules[name]

    @contextlib.contextmanager
    def _body(self, module: types.ModuleType) -> Iterator[None]:
        is_bridge = _is_bridge_name(module.__name__)
        triton_only = TRITON_ONLY_MODULES.get(module.__name__)
        self._stack.bridge.append(is_bridge)
        self._sync()
        try:
            try:
                yield
            except ModuleNotFoundError as error:
                if not (triton_only and (error.name or "").split(".")[0] == "triton"):
                    raise
                stand_ins = {name: _TritonKernelAbsent(module.__name__, name) for name in triton_only}
                vars(module).update(stand_ins, __cpu_runtime_stand_in__=True)
                self.served.append(module.__name__)
            if is_bridge:
                self._after_bridge_body(module)
        finally:
            self._stack.bridge.pop()
            self._sync()

    # ------------------------------------------------------------------ the TE stand-in
    def _serves_te(self, name: str) -> bool:
        if not (_is_te_name(name) and self.bridge_body_on_top() and _is_bridge_name(importing_module(__file__))):
            return False
        self.served.append(name)
        return True

    def _te_module(self, name: str) -> _TEStandIn:
        # one module per name, so every mcore-bridge body that imports it gets the same object
        with self._lock:
            module = self.te_modules.get(name)
            if module is None:
                module = self.te_modules[name] = _TEStandIn(name)
        return module

    def remove_stand_ins(self) -> None:
        """Drop the stand-ins from ``sys.modules``: modules imported meanwhile keep their references;
        a fresh import needs Transformer Engine / triton again, exactly as without this layer."""
        with self._lock:
            for name, module in self.te_modules.items():
                if sys.modules.get(name) is module:
                    del sys.modules[name]
            for name in TRITON_ONLY_MODULES:
                if getattr(sys.modules.get(name), "__cpu_runtime_stand_in__", False):
                    del sys.modules[name]


# ------------------------------ 4. The local spec and the weight layout of mcore-bridge's converter
def _local_spec(original: Callable[..., Any]) -> Callable[..., Any]:
    def spec_builder(*args: Any, **kwargs: Any) -> Any:
        kwargs["use_transformer_engine"] = False  # megatron-core's local spec, not TESpecProvider()
        return original(*args, **kwargs)

    spec_builder.__name__ = getattr(original, "__name__", "spec_builder")
    spec_builder.__doc__ = original.__doc__
    return spec_builder


#: TE-spec parameter keys of ``GPTBridge._set_state_dict`` -> the local spec's keys
LOCAL_NORM_KEYS = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}


def _local_norm_keys(original: Callable[..., Any]) -> Callable[..., Any]:
    def _set_state_dict(self: Any, mg_module: Any, mg_key: str, *args: Any, **kwargs: Any) -> Any:
        return original(self, mg_module, LOCAL_NORM_KEYS.get(mg_key, mg_key), *args, **kwargs)

    return _set_state_dict


class _GroupedLinearView:
    """``linear_fc1`` / ``linear_fc2`` of a :class:`GroupedExpertsView`: ``weight{i}`` (and
    ``bias{i}``) are the parameters of local expert ``i``."""

    def __init__(self, linears: list[Any]) -> None:
        for index, linear in enumerate(linears):
            setattr(self, f"weight{index}", linear.weight)
            if getattr(linear, "bias", None) is not None:
                setattr(self, f"bias{index}", linear.bias)


class GroupedExpertsView:
    """A megatron-core ``SequentialMLP`` as mcore-bridge's converter reads grouped experts.

    TE's grouped experts hold expert ``i``'s ``[2F, H]`` gate/up matrix as ``linear_fc1.weight{i}``
    and its ``[H, F]`` down matrix as ``linear_fc2.weight{i}``; ``SequentialMLP`` holds the same
    matrices (same row order: gate rows, then up rows) as ``local_experts[i].linear_fc1.weight`` and
    ``local_experts[i].linear_fc2.weight``. The view exposes the latter under the former's names;
    the tensors are the experts' own parameters.
    """

    def __init__(self, experts: Any) -> None:
        self.experts = experts
        self.linear_fc1 = _GroupedLinearView([expert.linear_fc1 for expert in experts.local_experts])
        self.linear_fc2 = _GroupedLinearView([expert.linear_fc2 for expert in experts.local_experts])
        self.config = experts.config


def _is_sequential_mlp(module: Any) -> bool:
    experts = sys.modules.get("megatron.core.transformer.moe.experts")
    return experts is not None and isinstance(module, experts.SequentialMLP)


def _sequential_experts(original: Callable[..., Any]) -> Callable[..., Any]:
    def _set_mlp_state(self: Any, mg_mlp: Any, *args: Any, **kwargs: Any) -> Any:
        if _is_sequential_mlp(mg_mlp):
            mg_mlp = GroupedExpertsView(mg_mlp)
        return original(self, mg_mlp, *args, **kwargs)

    return _set_mlp_state


# ------------------------------ enable / disable
class _Installed:
    scope: _BridgeImportScope | None = None


_INSTALLED = _Installed()


def _fix_bridge_module(patches: AttributePatches, module: types.ModuleType) -> None:
    """After an mcore-bridge module body ran: TE placeholders in its namespace, and the fixes of
    the two modules that build the spec and convert the weights."""
    te_extensions = sys.modules.get(TE_EXTENSIONS)
    if te_extensions is not None:
        te_names = vars(te_extensions)
        for name, value in list(vars(module).items()):
            if name.startswith("TE") and _is_absent_te_value(value) and te_names.get(name, object()) is value:
                patches.set(module, name, _placeholder(name))
    if module.__name__ == _REGISTER_MODULE:
        for name in ("get_gpt_decoder_block_spec", "get_gpt_mtp_block_spec"):
            if name in vars(module):
                patches.wrap(module, name, _local_spec)
    elif module.__name__ == _BRIDGE_MODULE:
        bridge = module.GPTBridge
        patches.wrap(bridge, "_set_state_dict", _local_norm_keys)
        patches.wrap(bridge, "_set_mlp_state", _sequential_experts)


def _install(patches: AttributePatches) -> None:
    from elastic_moe_plugin.cpu_runtime import MegatronCPUError

    already = sorted(name for name in sys.modules if _is_bridge_name(name))
    if already:
        raise MegatronCPUError(
            f"mcore_bridge is already imported ({already[0]}, ...): enable the Megatron-SWIFT CPU runtime before "
            "anything imports mcore_bridge (e.g. through elastic_moe_plugin.tools.child_bootstrap on "
            "PYTHONPATH with EMOE_BOOTSTRAP=megatron_swift)."
        )
    scope = _BridgeImportScope(lambda module: _fix_bridge_module(patches, module))
    scope.install()
    _INSTALLED.scope = scope

    def uninstall() -> None:
        scope.uninstall()
        _INSTALLED.scope = None

    patches.on_restore(uninstall)


_SWITCH = PatchSwitch(_install)


def enable(force: bool = False) -> None:
    """Switch on the CPU runtime for Megatron-SWIFT (idempotent): :func:`.runtime.enable` with
    ``training=True``, :mod:`.grad_clip`, and the mcore-bridge scope above.

    Call it before anything imports ``mcore_bridge`` (``swift.megatron`` does), in every process.

    Raises:
        MegatronCPUError: CUDA is available and ``force`` is False, or mcore_bridge is already imported.
    """
    from elastic_moe_plugin import cpu_runtime
    from elastic_moe_plugin.cpu_runtime import grad_clip

    cpu_runtime.enable(force=force, training=True)
    grad_clip.enable()
    _SWITCH.on()


def disable() -> None:
    """Remove the mcore-bridge scope and the gradient-clipping redirect (idempotent), restoring every
    attribute by identity. :func:`.runtime.disable` turns off the rest. mcore-bridge modules imported
    meanwhile stay imported, with their TE names as megatron-core bound them."""
    from elastic_moe_plugin.cpu_runtime import grad_clip

    _SWITCH.off()
    grad_clip.disable()


def is_enabled() -> bool:
    """Whether the mcore-bridge scope is installed."""
    return _SWITCH.is_on


def te_stand_in_visible() -> bool:
    """Whether ``transformer_engine`` would resolve to the stand-in right now (False outside an
    mcore-bridge module body, always False when disabled)."""
    scope = _INSTALLED.scope
    return scope is not None and scope.bridge_body_on_top()


def served_stand_ins() -> list[str]:
    """The stand-in modules handed out so far in this process (names, in order)."""
    scope = _INSTALLED.scope
    return list(scope.served) if scope is not None else []

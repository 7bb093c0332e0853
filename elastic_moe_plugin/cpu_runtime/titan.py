"""torchtitan's trainer on a CPU-only torch with gloo: six stand-ins, each for one CPU gap.

``torchrun -m torchtitan.train --module deepseek_v3 --config deepseek_v3_debugmodel`` stops on a
CPU-only torch 2.13 at the first of these (verified against torchtitan 0.3.0); with :func:`enable`
it trains. torchtitan's logic is never replaced: its device handle, one GPU-only module, one
function torch lacks, one collective option gloo lacks, and two kernels are answered on the CPU.

1. **Device type.** ``torchtitan.tools.utils`` binds ``device_type, device_module`` at import from
   ``_get_available_device_type() or "cuda"``: ``"cuda"`` on a CPU-only torch, so
   ``Trainer.__init__`` fails in ``torch.cuda.set_device`` ("AttributeError: module 'torch._C' has
   no attribute '_cuda_setDevice'"). With :func:`enable` that module and every torchtitan module
   that copied the two names (:data:`DEVICE_IMPORTERS`) answer ``"cpu"`` and
   :data:`CPU_DEVICE_MODULE`: ``torch.cpu`` plus what torchtitan asks a device module and
   ``torch.cpu`` lacks ("AttributeError: module 'torch.cpu' has no attribute 'get_device_name'",
   then ``memory_stats``, ``get_device_properties``, ...), and a ``current_device()`` of ``0``
   (``torch.cpu`` answers ``"cpu"``; torchtitan builds ``torch.device(device_type, index)``). The
   attributes are set now if the module is imported, else right after its import. Memory readings
   are unknown on the CPU: the step log shows ``memory: -0.00GiB(-0.00%)``.
2. **MinimalAsyncEP's triton kernels.** ``torchtitan.models.common.token_dispatcher`` imports
   ``torchtitan.distributed.minimal_async_ep``, whose ``kernels`` module does ``import triton`` at
   its top: "ModuleNotFoundError: No module named 'triton'" on any ``import torchtitan.train``.
   Where triton is not importable, ``sys.modules`` holds a stand-in for :data:`KERNELS_MODULE`
   whose launchers raise :class:`MegatronCPUError` if called (only the GPU-only
   ``moe_comm_backend="minimal_async_ep"`` calls them). ``triton`` itself is never stubbed: torch
   probes it (inductor, ``torch.utils._triton``) and a stub sends torch down its triton paths.
3. **torch.distributed.set_timeout.** torchtitan 0.3.0 calls it after step 1 (``set_pg_timeouts``);
   torch 2.13 lacks it ("AttributeError: module 'torch.distributed' has no attribute
   'set_timeout'"). Added, only where missing, as ``distributed_c10d._set_pg_timeout``.
4. **FSDP2's PREMUL_SUM on gloo.** torchtitan sets a gradient divide factor of 1 on every FSDP
   module (it scales by the global token count itself); with more than one data-parallel rank
   FSDP2 then reduce-scatters with ``ReduceOp.PREMUL_SUM(1/factor)``, which gloo lacks
   ("RuntimeError: Cannot use ReduceOp.PREMUL_SUM with Gloo"). On a gloo group
   ``_get_gradient_divide_factors`` takes FSDP's own sum-reduction path (its
   ``force_sum_reduction_for_comms``: reduce with SUM, then divide by the factor): on 2 ranks the
   gradients equal the hand-computed sum (factor 1) or mean (no factor) of the ranks' gradients
   exactly. (On one rank the factor equals the group size and FSDP picks ``AVG``, which gloo has.)
5. **FlexAttention's backward.** torch 2.13's ``flex_attention`` has no CPU backward, compiled or
   eager ("FlexAttention does not support backward on CPU"). ``FlexAttention._compiled_flex_attn``
   becomes :func:`dense_flex_attention`: softmax attention over the block mask's element mask
   (``create_mask`` of its ``mask_mod``), with the log-sum-exp when asked. ``score_mod`` is refused.
   torchtitan's ``--debug.deterministic`` assigns a compiled ``flex_attention`` there again
   (``set_determinism``), so a CPU run leaves it off.
6. **Grouped GEMM, for speed only.** On the CPU ``torch._grouped_mm`` in bfloat16 is much slower
   than one float32 matmul per expert: 2048 tokens over 8 experts of 256 x 256 take 32 ms forward
   and 216 ms backward against 5 ms and 11 ms (one thread). ``GroupedExperts._grouped_mm``
   (torchtitan's own seam; GPT-OSS's experts inherit it) becomes :func:`fp32_grouped_mm`: the bf16
   inputs multiplied in float32 and rounded once to bf16, as a GPU's bf16 GEMM accumulates, so only
   the summation order differs (the debug model's losses agree to the 5 digits torchtitan logs).

Part of the opt-in CPU runtime (:mod:`elastic_moe_plugin.cpu_runtime`): no adapter imports it, a GPU
run never loads it, and importing it imports no torchtitan. Switched on by :func:`enable`
in-process (before or after ``import torchtitan``, but before ``token_dispatcher`` is imported for
stand-in 2), or in every rank of ``torchrun`` by the child bootstrap's ``titan`` feature
(:mod:`elastic_moe_plugin.tools.child_bootstrap`). :func:`disable` restores every attribute by
identity, removes the kernels stand-in from ``sys.modules`` and cancels pending installs; torchtitan
modules imported meanwhile keep their references (``DeviceMemoryMonitor``'s unused default argument
``f"{device_type}:0"`` among them).
"""

from __future__ import annotations

import datetime
import functools
import importlib.util
import os
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

from elastic_moe_plugin.core.patching import AttributePatches, PatchSwitch
from elastic_moe_plugin.cpu_runtime.errors import MegatronCPUError

__all__ = [
    "ATTENTION_MODULE",
    "CPU_DEVICE_MODULE",
    "DEVICE_IMPORTERS",
    "FSDP_COLLECTIVES_MODULE",
    "KERNELS_MODULE",
    "MOE_MODULE",
    "TOOLS_UTILS_MODULE",
    "dense_flex_attention",
    "disable",
    "enable",
    "fp32_grouped_mm",
    "is_enabled",
]

#: binds ``device_type, device_module`` at import
TOOLS_UTILS_MODULE = "torchtitan.tools.utils"
#: the modules that copy those names (``from torchtitan.tools.utils import device_type, ...``)
DEVICE_IMPORTERS = (
    "torchtitan.components.metrics",
    "torchtitan.distributed.parallel_dims",
    "torchtitan.distributed.utils",
    "torchtitan.models.common.token_dispatcher",
    "torchtitan.tools.profiler",
    "torchtitan.experiments.graph_trainer.llama3.parallelize_autoparallel",
    "torchtitan.experiments.graph_trainer.deepseek_v3.parallelize_autoparallel",
)
#: MinimalAsyncEP's triton kernels (``import triton`` at its top)
KERNELS_MODULE = "torchtitan.distributed.minimal_async_ep.kernels"
#: the launchers ``minimal_async_ep/api.py`` imports from :data:`KERNELS_MODULE`
_KERNEL_LAUNCHERS = (
    "copy_full_counts_to_peers_kernel",
    "copy_rows_to_peers_kernel",
    "expand_topk_grad_kernel",
    "fill_combine_metadata_kernel",
    "fill_dispatch_metadata_kernel",
    "invert_flat_indices_kernel",
    "reduce_topk_slots_kernel",
    "topk_scores_grad_kernel",
)
#: holds ``FlexAttention``
ATTENTION_MODULE = "torchtitan.models.common.attention"
#: holds ``GroupedExperts``
MOE_MODULE = "torchtitan.models.common.moe"
#: holds FSDP2's ``_get_gradient_divide_factors`` (called by name from ``foreach_reduce``)
FSDP_COLLECTIVES_MODULE = "torch.distributed.fsdp._fully_shard._fsdp_collectives"


# ------------------------------------------------------------------------------ 1. device type
def _cpu_device_module() -> types.ModuleType:
    """``torch.cpu`` (every name it has) plus the answers torchtitan asks of a device module."""
    properties = types.SimpleNamespace(
        name="cpu", total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    )
    module = types.ModuleType(
        "elastic_moe_plugin.cpu_runtime.titan.cpu_device", "torch.cpu, as torchtitan's device module."
    )
    answers: dict[str, Any] = {
        "__getattr__": lambda name: getattr(torch.cpu, name),  # the rest is torch.cpu's
        "current_device": lambda: 0,  # torch.cpu: "cpu", and torchtitan builds torch.device(type, index)
        "device_count": lambda: 1,  # one device per process: every rank places on cpu:0
        "set_device": lambda device: None,
        "synchronize": lambda device=None: None,
        "get_device_name": lambda device=None: "cpu",
        "get_device_properties": lambda device=None: properties,
        "memory_stats": lambda device=None: {},  # unknown: torchtitan logs -1 bytes
        "reset_peak_memory_stats": lambda device=None: None,
        "empty_cache": lambda: None,
        "memory": types.SimpleNamespace(_record_memory_history=lambda *args, **kwargs: None, _snapshot=lambda: {}),
    }
    vars(module).update(answers)
    return module


#: what torchtitan sees as its device module under the runtime
CPU_DEVICE_MODULE = _cpu_device_module()
_CPU_DEVICE = {"device_type": "cpu", "device_module": CPU_DEVICE_MODULE}


def _install_device(patches: AttributePatches) -> None:
    stock: dict[str, Any] = {}  # the names as torchtitan.tools.utils bound them

    def redirect_tools_utils(module: types.ModuleType) -> None:
        for name, value in _CPU_DEVICE.items():
            stock[name] = vars(module)[name]
            patches.set(module, name, value)

    def redirect_importer(module: types.ModuleType) -> None:
        for name, value in _CPU_DEVICE.items():
            if name not in vars(module):
                continue
            if vars(module)[name] is value:
                # copied while redirected: what it copies without the runtime is what restore puts back
                setattr(module, name, stock[name])
            patches.set(module, name, value)

    patches.when_imported(TOOLS_UTILS_MODULE, redirect_tools_utils)  # first: the importers read stock
    for module_name in DEVICE_IMPORTERS:
        patches.when_imported(module_name, redirect_importer)


# ------------------------------------------------------------------------------ 2. kernels
def _unavailable_launcher(name: str) -> Callable[..., Any]:
    def launch(*args: Any, **kwargs: Any) -> Any:
        raise MegatronCPUError(
            f"{KERNELS_MODULE}.{name} is a CPU stand-in installed by elastic_moe_plugin.cpu_runtime.titan; "
            "MinimalAsyncEP needs triton and GPUs. Use moe_comm_backend='standard' on the CPU."
        )

    launch.__name__ = launch.__qualname__ = name
    return launch


def _install_kernels_stand_in(patches: AttributePatches) -> None:
    if KERNELS_MODULE in sys.modules or importlib.util.find_spec("triton") is not None:
        return  # imported already, or the real module imports fine
    stand_in = types.ModuleType(
        KERNELS_MODULE, "CPU stand-in for MinimalAsyncEP's triton kernels (elastic_moe_plugin.cpu_runtime.titan)."
    )
    vars(stand_in).update(
        {name: _unavailable_launcher(name) for name in _KERNEL_LAUNCHERS},
        __all__=list(_KERNEL_LAUNCHERS),
        __cpu_runtime_stand_in__=True,
    )
    sys.modules[KERNELS_MODULE] = stand_in

    def remove() -> None:
        # modules imported meanwhile keep their references; a fresh import needs triton again
        if sys.modules.get(KERNELS_MODULE) is stand_in:
            del sys.modules[KERNELS_MODULE]

    patches.on_restore(remove)


# ------------------------------------------------------------------------------ 3. set_timeout
def _set_timeout(timeout: datetime.timedelta, group: torch.distributed.ProcessGroup | None = None) -> None:
    """``torch.distributed.set_timeout`` of newer torch: the timeout of ``group`` (None: the default group)."""
    torch.distributed.distributed_c10d._set_pg_timeout(timeout, group)


# ------------------------------------------------------------------------------ 4. FSDP2 on gloo
def _reduces_over_gloo(group: torch.distributed.ProcessGroup, device_type: str) -> bool:
    """Whether ``group`` reduces ``device_type`` tensors with gloo (a group with one backend per device
    type names them ``"cpu:gloo,cuda:nccl"``)."""
    backend = str(torch.distributed.get_backend(group))
    return backend == "gloo" or f"{device_type}:gloo" in backend.split(",")


def _summing_on_gloo(stock: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(stock)
    def _get_gradient_divide_factors(
        reduce_scatter_group: torch.distributed.ProcessGroup | None,
        all_reduce_group: torch.distributed.ProcessGroup | None,
        reduce_dtype: torch.dtype,
        device_type: str = "",
        factor: float | None = None,
        force_sum_reduction_for_comms: bool = False,
    ) -> Any:
        """FSDP2's reduce ops and divide factors; on a gloo group its SUM-then-divide path (gloo has no
        ``PREMUL_SUM``)."""
        groups = [group for group in (reduce_scatter_group, all_reduce_group) if group is not None]
        if any(_reduces_over_gloo(group, device_type) for group in groups):
            force_sum_reduction_for_comms = True
        return stock(
            reduce_scatter_group, all_reduce_group, reduce_dtype, device_type, factor, force_sum_reduction_for_comms
        )

    return _get_gradient_divide_factors


# ------------------------------------------------------------------------------ 5. attention
def _element_mask(
    block_mask: Any, batch: int, heads: int, q_len: int, kv_len: int, device: torch.device
) -> torch.Tensor:
    """The block mask's ``mask_mod`` evaluated at every (query, key): bool ``[B or 1, H or 1, L, S]``."""
    from torch.nn.attention.flex_attention import create_mask

    mask_batch = batch if block_mask.shape[0] == batch else None
    mask_heads = heads if block_mask.shape[1] == heads else None
    return create_mask(block_mask.mask_mod, mask_batch, mask_heads, q_len, kv_len, device=device)


def dense_flex_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    score_mod: Any = None,
    block_mask: Any = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    kernel_options: Any = None,
    *,
    return_aux: Any = None,
) -> Any:
    """``flex_attention`` without ``score_mod``, computed densely in float32 on any device.

    ``query`` ``[B, Hq, L, E]``, ``key`` ``[B, Hkv, S, E]``, ``value`` ``[B, Hkv, S, Ev]`` (``Hq`` a
    multiple of ``Hkv``: grouped-query heads are repeated). With scores ``s = q·kᵀ·scale`` (scale
    ``E^-1/2`` by default) set to ``-inf`` where the block mask's ``mask_mod`` is False:

        lse = logsumexp_S(s)        out = exp(s - lse) · v     (a row with no key: out 0, lse -inf)

    ``out`` ``[B, Hq, L, Ev]`` in ``query``'s dtype, ``lse`` ``[B, Hq, L]`` in float32. Returns as
    ``flex_attention`` does: ``(out, AuxOutput)`` when ``return_aux`` is given, ``(out, lse)`` with
    ``return_lse``, else ``out``. ``kernel_options`` is ignored (no kernel).

    Raises:
        MegatronCPUError: ``score_mod`` is given (only masks are covered).
    """
    from torch.nn.attention.flex_attention import AuxOutput

    if score_mod is not None:
        raise MegatronCPUError(
            "the CPU stand-in of FlexAttention (elastic_moe_plugin.cpu_runtime.titan) covers block masks only, "
            "not score_mod; run on a GPU without the CPU runtime."
        )
    batch, heads, q_len, head_dim = query.shape
    kv_heads, kv_len = key.shape[-3], key.shape[-2]
    if heads != kv_heads:
        key = key.repeat_interleave(heads // kv_heads, dim=-3)
        value = value.repeat_interleave(heads // kv_heads, dim=-3)
    scores = torch.matmul(query.float(), key.float().transpose(-2, -1)) * (head_dim**-0.5 if scale is None else scale)
    if block_mask is not None:
        scores = scores.masked_fill(~_element_mask(block_mask, batch, heads, q_len, kv_len, query.device), -torch.inf)
    lse = torch.logsumexp(scores, dim=-1)
    # exp(s - lse) is the softmax; a row with no key gets exp(-inf) = 0 rather than softmax's NaN
    probabilities = torch.exp(scores - lse.masked_fill(lse.isneginf(), 0.0).unsqueeze(-1))
    out = torch.matmul(probabilities, value.float()).to(query.dtype)
    if return_aux is not None:
        max_scores = scores.amax(dim=-1) if return_aux.max_scores else None
        return out, AuxOutput(lse=lse if return_aux.lse else None, max_scores=max_scores)
    return (out, lse) if return_lse else out


# ------------------------------------------------------------------------------ 6. grouped GEMM
def fp32_grouped_mm(self: Any, *, A: torch.Tensor, B_t: torch.Tensor, offs: torch.Tensor | None) -> torch.Tensor:
    """``torch._grouped_mm(A, B_t, offs=offs)`` as one float32 matmul per expert, in ``A``'s dtype.

    ``A`` ``[R, K]`` holds the tokens of expert ``e`` in rows ``offs[e-1]:offs[e]`` (``offs`` ``[E]``,
    cumulative); ``B_t`` ``[E, K, N]``. Returns ``[R, N]``; rows past ``offs[-1]`` (padding) are 0.
    Other layouts (no ``offs``) go to ``torch._grouped_mm``.
    """
    if offs is None or A.dim() != 2:
        return torch._grouped_mm(A, B_t, offs=offs)
    sizes = torch.diff(offs, prepend=offs.new_zeros(1)).tolist()
    rows = sum(sizes)
    products = [
        tokens.float() @ weight.float() for tokens, weight in zip(A[:rows].split(sizes), B_t.unbind(0), strict=True)
    ]
    if rows < A.shape[0]:
        products.append(A.new_zeros(A.shape[0] - rows, B_t.shape[-1], dtype=torch.float32))
    return torch.cat(products).to(A.dtype)


# ------------------------------------------------------------------------------ the switch
def _install(patches: AttributePatches) -> None:
    _install_kernels_stand_in(patches)  # first: before any import of torchtitan's token dispatcher
    _install_device(patches)
    if not hasattr(torch.distributed, "set_timeout"):
        patches.set(torch.distributed, "set_timeout", _set_timeout)

    def redirect_fsdp(module: types.ModuleType) -> None:
        patches.wrap(module, "_get_gradient_divide_factors", _summing_on_gloo)

    def redirect_attention(module: types.ModuleType) -> None:
        patches.set(module.FlexAttention, "_compiled_flex_attn", staticmethod(dense_flex_attention))

    def redirect_experts(module: types.ModuleType) -> None:
        patches.set(module.GroupedExperts, "_grouped_mm", fp32_grouped_mm)

    patches.when_imported(FSDP_COLLECTIVES_MODULE, redirect_fsdp)
    patches.when_imported(ATTENTION_MODULE, redirect_attention)
    patches.when_imported(MOE_MODULE, redirect_experts)


_SWITCH = PatchSwitch(_install)


def enable(force: bool = False) -> None:
    """Answer torchtitan's CPU gaps (module docstring; idempotent). Before or after ``import
    torchtitan``; before its token dispatcher is imported where triton is absent.

    Raises:
        MegatronCPUError: CUDA is available and ``force`` is False (on a GPU torchtitan needs none of
            this, and a redirect would silently train on the CPU).
    """
    if not _SWITCH.is_on and torch.cuda.is_available() and not force:
        raise MegatronCPUError(
            "torch.cuda.is_available() is True: the torchtitan CPU runtime is for CPU-only hosts; run torchtitan "
            "on the GPU without elastic_moe_plugin.cpu_runtime.titan."
        )
    _SWITCH.on()


def disable() -> None:
    """Restore every redirected attribute by identity, remove the kernels stand-in from
    ``sys.modules`` and cancel pending installs (idempotent)."""
    _SWITCH.off()


def is_enabled() -> bool:
    """Whether torchtitan's CPU gaps are answered."""
    return _SWITCH.is_on

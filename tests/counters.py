"""The one op counter of the test suite: a ``TorchDispatchMode`` that counts the aten ops that run.

Every test that counts host syncs, calls of an op, or the rows a matmul multiplies uses this
module (no test defines its own ``TorchDispatchMode``). The root ``tests/conftest.py`` exposes the
fixtures below to every test folder; module-level helpers import from here directly
(``from counters import OpCounter, host_syncs``: ``tests/`` is on ``sys.path``).

API
---
``OpCounter(*ops, where=None, measure=None, fail=False)``: a context manager (``with OpCounter(...)
as counter:``) that sees every aten op dispatched inside it, forward and backward.

- ``ops``: which ops to count, each an ``OpOverload`` (that overload only:
  ``torch.ops.aten.nonzero.default``), an ``OpOverloadPacket`` (every overload:
  ``torch.ops.aten.scatter``) or a name (every overload: ``"nonzero"``, ``"aten.nonzero"``,
  ``"aten::nonzero"``). No ``ops``: every op.
- ``where(func, args, kwargs) -> bool``: a further filter, asked before the op runs (e.g. the
  shape of an argument); a call counts only where it returns true.
- ``measure(func, args, kwargs, out) -> int | list[int] | None``: asked after a counted op ran;
  each value it gives is appended to ``values`` (e.g. :func:`gemm_rows`, the rows a matmul
  multiplied). Ops that ``measure`` itself runs are not counted by this counter, but are by every
  counter entered before it: of nested counters, enter the measuring one first.
- ``fail``: raise ``AssertionError("counted op: <op>")`` at the first counted call, before it runs
  (and after counting it): a test that forbids an op gets the traceback of its caller.

Results, read inside or after the ``with`` block:

- ``count``: the counted calls; ``names``: their names (``func.overloadpacket.__name__``, e.g.
  ``"nonzero"``), in call order; ``by_name``: a ``collections.Counter`` of ``names``;
- ``of(*ops)``: how many counted calls were of ``ops`` (given as for the constructor);
- ``values``: ``[(name, value)]`` of every call ``measure`` gave a value for; ``total``: their sum.

Helpers for the usual questions:

- ``host_syncs(ops=SYNC_OPS, megatron=False, fail=False)``: counts the ops that make the host wait
  for the device: explicit reads (``EXPLICIT_SYNCS``: ``aten._local_scalar_dense``, what
  ``.item()``, ``int(t)``, ``.tolist()`` run) and ops whose output size is data
  (``DATA_SIZED_OPS``: ``nonzero``, ``masked_select``). ``megatron=True`` leaves out the
  host-only explicit read inside Megatron's RNG-tracker fork (``cpu_runtime.in_rng_tracker_fork``
  says why).
- ``op_calls(*ops)``: ``OpCounter(*ops)``; ``all_ops()``: ``OpCounter()`` (every op; on a GPU each
  is a kernel launch or a copy).
- ``gemm_rows(func, args, kwargs, out)``: the ``measure`` of a matmul's rows: ``offs[-1]`` of a
  ``_grouped_mm`` (the kernel multiplies rows below the last offset only), the batch of a
  ``bmm``, the output rows of an ``mm``; None for any other op.
- ``matmul_rows(where=None)``: ``OpCounter("mm", "bmm", "_grouped_mm", where=where,
  measure=gemm_rows)``.
- ``ExpertRows(model)``: an :class:`OpCounter` of the rows every experts module of a transformers
  ``model`` multiplies (``rows[name]``) and of every grouped GEMM's ``offs[-1]``
  (``grouped_offsets``); its docstring says how each implementation is recognised.

Fixtures (``tests/conftest.py``): ``op_counter`` (the class :class:`OpCounter`) and
``count_host_syncs`` (the function :func:`host_syncs`).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["DATA_SIZED_OPS", "EXPLICIT_SYNCS", "SYNC_OPS", "ExpertRows", "OpCounter", "all_ops", "count_host_syncs",
           "gemm_rows", "host_syncs", "matmul_rows", "op_calls", "op_counter"]

aten = torch.ops.aten

EXPLICIT_SYNCS = (aten._local_scalar_dense.default,)
DATA_SIZED_OPS = (aten.nonzero.default, aten.masked_select.default)
SYNC_OPS = EXPLICIT_SYNCS + DATA_SIZED_OPS


def _name(op: Any) -> str:
    """The packet name of an op given as an overload, a packet or a string."""
    if isinstance(op, str):
        return op.replace("::", ".").removeprefix("aten.").split(".")[0]
    if isinstance(op, torch._ops.OpOverload):
        return op.overloadpacket.__name__
    if isinstance(op, torch._ops.OpOverloadPacket):
        return op.__name__
    raise TypeError(f"not an aten op: {op!r}")


class _Ops:
    """Matches a call against overloads (exact) and names (any overload)."""

    def __init__(self, ops: tuple) -> None:
        self.everything = not ops
        self.overloads = {op for op in ops if isinstance(op, torch._ops.OpOverload)}
        self.names = {_name(op) for op in ops if not isinstance(op, torch._ops.OpOverload)}

    def __contains__(self, func) -> bool:
        return self.everything or func in self.overloads or func.overloadpacket.__name__ in self.names


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched inside it (see the module docstring for the API)."""

    def __init__(self, *ops: Any, where: Callable[..., bool] | None = None,
                 measure: Callable[..., int | None] | None = None, fail: bool = False) -> None:
        super().__init__()
        self._ops = _Ops(ops)
        self._where, self._measure, self._fail = where, measure, fail
        self.names: list[str] = []
        self.values: list[tuple[str, int]] = []
        self._funcs: list[Any] = []

    @property
    def count(self) -> int:
        return len(self.names)

    @property
    def by_name(self) -> collections.Counter:
        return collections.Counter(self.names)

    @property
    def total(self) -> int:
        return sum(value for _, value in self.values)

    def of(self, *ops: Any) -> int:
        wanted = _Ops(ops)
        return sum(1 for func in self._funcs if func in wanted)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        counted = func in self._ops and (self._where is None or self._where(func, args, kwargs))
        if counted:
            self._funcs.append(func)
            self.names.append(func.overloadpacket.__name__)
            if self._fail:
                raise AssertionError(f"counted op: {func}")
        out = func(*args, **kwargs)
        if counted and self._measure is not None:
            value = self._measure(func, args, kwargs, out)
            for one in value if isinstance(value, (list, tuple)) else () if value is None else (value,):
                self.values.append((func.overloadpacket.__name__, int(one)))
        return out


def _outside_megatron_rng_fork(func, args, kwargs) -> bool:
    """False for an explicit read inside Megatron's RNG-tracker fork (a comparison of two CPU RNG states)."""
    if func not in EXPLICIT_SYNCS:
        return True
    from elastic_moe_plugin import cpu_runtime

    return not cpu_runtime.in_rng_tracker_fork()


def host_syncs(ops: tuple = SYNC_OPS, megatron: bool = False, fail: bool = False) -> OpCounter:
    """An :class:`OpCounter` of the host syncs ``ops`` (default: explicit reads and data-sized
    outputs); ``megatron=True`` skips the host-only explicit read in Megatron's RNG-tracker fork.
    ``counter.of(*EXPLICIT_SYNCS)`` and ``counter.of(*DATA_SIZED_OPS)`` split the count."""
    return OpCounter(*ops, where=_outside_megatron_rng_fork if megatron else None, fail=fail)


def op_calls(*ops: Any) -> OpCounter:
    """An :class:`OpCounter` of the calls of ``ops``."""
    return OpCounter(*ops)


def all_ops() -> OpCounter:
    """An :class:`OpCounter` of every op that runs."""
    return OpCounter()


def gemm_rows(func, args, kwargs, out) -> int | None:
    """The rows a matmul multiplied: ``offs[-1]`` of a ``_grouped_mm``, the batch of a ``bmm``, the
    output rows of an ``mm``; None for any other op."""
    name = func.overloadpacket.__name__
    if name == "_grouped_mm":
        return int(kwargs.get("offs", args[2] if len(args) > 2 else None)[-1])
    if name == "bmm":
        return args[0].shape[0]
    if name == "mm":
        return out.shape[0]
    return None


def matmul_rows(where: Callable[..., bool] | None = None) -> OpCounter:
    """An :class:`OpCounter` of the rows every ``mm``, ``bmm`` and ``_grouped_mm`` multiplies (``values``,
    ``total``), those ``where`` accepts."""
    return OpCounter("mm", "bmm", "_grouped_mm", where=where, measure=gemm_rows)


class ExpertRows(OpCounter):
    """The (token, expert) rows every experts module of ``model`` multiplies, counted at the GEMMs
    that really run (independent of the plugin's own bookkeeping); shared by the transformers and
    ms-swift tests.

    ``rows[name]``: rows through the up-projection GEMM (``gate_up_proj``, or ``up_proj`` where the
    experts have no gate, as Nemotron-H's) of experts module ``name`` in the forwards run under the
    mode, recognised by shape in each implementation of transformers. With D_in = H and D_out = 2F
    (F without a gate), the weight is [E, D_out, D_in], or [E, D_in, D_out] where the experts are
    ``is_transposed`` (GPT-OSS, Aria); under DeepSpeed ZeRO-3, the gathered shape (``ds_shape``):

    - eager: ``aten.mm(x [n, D_in], W_e^T [D_in, D_out])`` (or ``x @ W_e``) per expert e: n rows;
    - batched_mm: ``aten.bmm(W [S, D_out, D_in], x [S, D_in, 1])``, or transposed
      ``aten.bmm(x [S, 1, D_in], W [S, D_in, D_out])``: S rows (one gathered matrix per row);
    - grouped_mm: ``aten._grouped_mm(x [S, D_in], W [E, D_in, D_out], offs)``: ``offs[-1]`` rows
      (the kernel multiplies rows below the last offset only).

    The down-projection has the shape reversed, so it is never counted while D_in ≠ D_out (the
    tiny models have H ≠ F). DBRX's experts hold one GLU module (``mlp``: ``w1``, ``v1``, ``w2``
    [E·F, H]) that their loop calls once per expert hit: the rows of its input are counted.

    ``grouped_offsets``: ``offs[-1]`` of every grouped GEMM, forward and backward (gate_up, down,
    and both gradients of each), in call order.
    """

    def __init__(self, model: torch.nn.Module):
        super().__init__("mm", "bmm", "_grouped_mm", measure=self._attribute)
        self.rows: dict[str, int] = {}
        self.grouped_offsets: list[int] = []
        self._current: tuple[str, tuple[int, int]] | None = None
        self._handles = []
        for name, module in model.named_modules():
            glu = getattr(module, "mlp", None)
            if isinstance(getattr(glu, "w1", None), torch.nn.Parameter):  # DBRX: one GLU called per expert
                self.rows[name] = 0
                self._handles.append(glu.register_forward_pre_hook(self._count_glu_rows(name)))
                continue
            proj = getattr(module, "gate_up_proj", None)
            if proj is None:
                proj = getattr(module, "up_proj", None)
            # DeepSpeed ZeRO-3 keeps a parameter as an empty local shard outside its module's
            # forward; ``ds_shape`` is the shape the forward gathers
            shape = getattr(proj, "ds_shape", None) or getattr(proj, "shape", ())
            if isinstance(proj, torch.nn.Parameter) and len(shape) == 3:
                self.rows[name] = 0
                d_out, d_in = shape[1:] if not getattr(module, "is_transposed", False) else shape[:0:-1]
                self._handles.append(module.register_forward_pre_hook(self._enter(name, (d_out, d_in))))
                self._handles.append(module.register_forward_hook(self._leave))

    def _count_glu_rows(self, name):
        def hook(module, args):
            self.rows[name] += args[0].shape[0]  # the rows of the one expert this call computes
        return hook

    def _enter(self, name, shape):
        def hook(module, args):
            self._current = (name, shape)
        return hook

    def _leave(self, module, args, output):
        self._current = None

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        return super().__exit__(*exc)

    def _attribute(self, func, args, kwargs, out) -> int:
        rows = gemm_rows(func, args, kwargs, out)
        op = func.overloadpacket.__name__
        if op == "_grouped_mm":
            self.grouped_offsets.append(rows)
        if self._current is not None:
            name, (d_out, d_in) = self._current
            if (op == "mm" and tuple(args[1].shape) == (d_in, d_out)) or (op == "bmm" and (
                    tuple(args[0].shape[1:]) == (d_out, d_in)
                    or (tuple(args[0].shape[1:]) == (1, d_in) and tuple(args[1].shape[1:]) == (d_in, d_out)))) \
                    or (op == "_grouped_mm" and tuple(args[1].shape[1:]) == (d_in, d_out)):
                self.rows[name] += rows
        return rows


@pytest.fixture
def op_counter() -> type[OpCounter]:
    """The class :class:`OpCounter`: ``with op_counter(torch.ops.aten.topk.default) as counted: ...``."""
    return OpCounter


@pytest.fixture
def count_host_syncs() -> Callable[..., OpCounter]:
    """The function :func:`host_syncs`: ``with count_host_syncs(megatron=True) as syncs: ...``."""
    return host_syncs

"""Shared by the transformers and ms-swift tests: the rows the experts modules of a model multiply,
counted at the GEMMs that really run (independent of the plugin's own bookkeeping)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class ExpertRows(TorchDispatchMode):
    """The (token, expert) rows every experts module of ``model`` multiplies, counted at the GEMMs.

    ``rows[name]``: rows through the up-projection GEMM (``gate_up_proj``, or ``up_proj`` where the
    experts have no gate, as Nemotron-H's) of experts module ``name`` in the forwards run under the
    mode, recognised by shape in each implementation of transformers. With D_in = H and D_out = 2F
    (F without a gate), the weight is [E, D_out, D_in], or [E, D_in, D_out] where the experts are
    ``is_transposed`` (GPT-OSS, Aria):

    - eager: ``aten.mm(x [n, D_in], W_e^T [D_in, D_out])`` (or ``x @ W_e``) per expert e: n rows;
    - batched_mm: ``aten.bmm(W [S, D_out, D_in], x [S, D_in, 1])``, or transposed
      ``aten.bmm(x [S, 1, D_in], W [S, D_in, D_out])``: S rows (one gathered matrix per row);
    - grouped_mm: ``aten._grouped_mm(x [S, D_in], W [E, D_in, D_out], offs)``: ``offs[-1]`` rows
      (the kernel multiplies rows below the last offset only).

    The down-projection has the shape reversed, so it is never counted while D_in ≠ D_out (the
    tiny models have H ≠ F).

    ``grouped_offsets``: ``offs[-1]`` of every grouped GEMM, forward and backward (gate_up, down,
    and both gradients of each), in call order.
    """

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.rows: dict[str, int] = {}
        self.grouped_offsets: list[int] = []
        self._current: tuple[str, tuple[int, int]] | None = None
        self._handles = []
        for name, module in model.named_modules():
            proj = getattr(module, "gate_up_proj", None)
            if proj is None:
                proj = getattr(module, "up_proj", None)
            if isinstance(proj, torch.nn.Parameter) and proj.dim() == 3:
                self.rows[name] = 0
                d_out, d_in = proj.shape[1:] if not getattr(module, "is_transposed", False) else proj.shape[:0:-1]
                self._handles.append(module.register_forward_pre_hook(self._enter(name, (d_out, d_in))))
                self._handles.append(module.register_forward_hook(self._leave))

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

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = func.overloadpacket.__name__
        if op == "_grouped_mm":
            self.grouped_offsets.append(int(kwargs.get("offs", args[2] if len(args) > 2 else None)[-1]))
        if self._current is not None:
            name, (d_out, d_in) = self._current
            if op == "mm" and tuple(args[1].shape) == (d_in, d_out):
                self.rows[name] += args[0].shape[0]
            elif op == "bmm" and (
                tuple(args[0].shape[1:]) == (d_out, d_in)
                or (tuple(args[0].shape[1:]) == (1, d_in) and tuple(args[1].shape[1:]) == (d_in, d_out))
            ):
                self.rows[name] += args[0].shape[0]
            elif op == "_grouped_mm" and tuple(args[1].shape[1:]) == (d_in, d_out):
                self.rows[name] += self.grouped_offsets[-1]
        return func(*args, **kwargs)

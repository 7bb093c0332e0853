"""``torch.distributed`` as gloo accepts it: two collectives Megatron calls the way NCCL allows.

Installed by :func:`install` (every ``cpu_runtime.enable()``, when ``torch.distributed`` is
available); each replacement calls the stock function it replaced.

* ``all_to_all_single``: split sizes given as tensors become int lists. On a GPU Megatron's
  ``maybe_move_tensor_to_cpu(..., as_numpy=True)`` turns the alltoall split sizes into numpy arrays,
  but it only converts CUDA tensors, so on CPU they stay tensors, which ``all_to_all_single``
  rejects.
* ``all_gather`` on a gloo group with unequal first dimensions: pads to the largest, gathers, and
  copies back (gloo rejects unequal sizes; NCCL accepts them). Used by the alltoall dispatcher when
  expert tensor parallelism is > 1. gloo's list ``reduce_scatter`` already accepts unequal sizes on
  torch 2.13 and is left alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from elastic_moe_plugin.core.patching import AttributePatches


def _as_int_list(split_sizes: Any) -> Any:
    if split_sizes is None or isinstance(split_sizes, list):
        return split_sizes
    return [int(s) for s in split_sizes]


def _all_to_all_single_with_int_splits(stock: Callable[..., Any]) -> Callable[..., Any]:
    def all_to_all_single(
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Any = None,
        input_split_sizes: Any = None,
        group: Any = None,
        async_op: bool = False,
    ) -> Any:
        """all_to_all_single with tensor split sizes converted to int lists (CUDA path gives numpy)."""
        return stock(
            output,
            input,
            output_split_sizes=_as_int_list(output_split_sizes),
            input_split_sizes=_as_int_list(input_split_sizes),
            group=group,
            async_op=async_op,
        )

    return all_to_all_single


def _all_gather_padded_on_gloo(stock: Callable[..., Any]) -> Callable[..., Any]:
    def all_gather(
        tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False
    ) -> Any:
        """all_gather that pads unequal first dimensions on gloo (gloo rejects them, NCCL does not)."""
        shapes = {tuple(t.shape) for t in tensor_list}
        if (
            async_op
            or len(shapes) <= 1
            or len({shape[1:] for shape in shapes}) != 1
            or torch.distributed.get_backend(group) != "gloo"
        ):
            return stock(tensor_list, tensor, group=group, async_op=async_op)
        longest = max(t.shape[0] for t in tensor_list)
        padded = tensor.new_zeros((longest,) + tuple(tensor.shape[1:]))
        padded[: tensor.shape[0]].copy_(tensor)
        gathered = [torch.empty_like(padded) for _ in tensor_list]
        stock(gathered, padded, group=group)
        for out, full in zip(tensor_list, gathered, strict=True):
            out.copy_(full[: out.shape[0]])
        return None

    return all_gather


def install(patches: AttributePatches) -> None:
    """Adapt the two collectives (module docstring); nothing when torch has no distributed package."""
    if not torch.distributed.is_available():
        return
    for name, adapt in (
        ("all_to_all_single", _all_to_all_single_with_int_splits),
        ("all_gather", _all_gather_padded_on_gloo),
    ):
        patches.set(torch.distributed, name, adapt(getattr(torch.distributed, name)))


__all__ = ["install"]

"""Values attached to a tensor's data, found again from any alias of it.

An elastic router hands what it dispatched to the code downstream by marking the tensors it
returns: its ``top_k_index`` [T, b] tells the experts which slots to compute
(:func:`~elastic_moe_plugin.hf.routing.mark_kept_slots`), its logits tell the load-balancing loss
what was dispatched (:func:`~elastic_moe_plugin.hf.routing.dispatched_slots`). The tensor object
does not always survive the way there: DeepSpeed ZeRO-3 passes every input and output of every
module through an autograd function that returns ``tensor.detach()``, a new object over the same
data. A mark keyed by object identity is lost at the first module boundary: the experts then
compute all T·b slots and the loss recounts a static top-b.

:class:`TensorMarks` keys a mark by the tensor's data instead: its storage (held weakly), offset,
shape, strides and dtype. Every alias with those (``detach``, ZeRO-3's hooks, a view of the same
elements) finds it; a copy (``clone``, a rebuilt tensor) does not, and gets the stock behaviour. A
mark dies with its storage. The key is sound: while an entry's weak reference exists, the storage's
control block is not freed, so no other storage can take its address. A tensor without storage of
its own (a ``DTensor``, a fake tensor) is keyed by identity, as before.
"""

from __future__ import annotations

from typing import Generic, TypeVar

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["TensorMarks"]

Value = TypeVar("Value")


class TensorMarks(Generic[Value]):
    """A mapping from tensors to values, keyed by the tensor's data (module docstring).

    ``marks[tensor] = value``; ``marks.get(tensor)``, ``marks[tensor]`` (``KeyError`` if unmarked).
    """

    def __init__(self) -> None:
        self._by_data: dict[tuple, tuple[StorageWeakRef, Value]] = {}
        self._by_identity: WeakIdKeyDictionary = WeakIdKeyDictionary()

    @staticmethod
    def _key(tensor: torch.Tensor) -> tuple | None:
        """(storage pointer, offset, shape, strides, dtype), or None where there is no plain storage."""
        if type(tensor) is not torch.Tensor and not isinstance(tensor, torch.nn.Parameter):
            return None
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return None
        # StorageWeakRef hashes and compares by the storage's address
        return (StorageWeakRef(storage), tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.dtype)

    def __setitem__(self, tensor: torch.Tensor, value: Value) -> None:
        key = self._key(tensor)
        if key is None:
            self._by_identity[tensor] = value
            return
        self._forget_expired()
        self._by_data[key] = (key[0], value)

    def get(self, tensor: torch.Tensor, default: Value | None = None) -> Value | None:
        key = self._key(tensor)
        if key is None:
            return self._by_identity.get(tensor, default)
        entry = self._by_data.get(key)
        if entry is None or entry[0].expired():
            return default
        return entry[1]

    def __getitem__(self, tensor: torch.Tensor) -> Value:
        marked = self.get(tensor, _UNMARKED)  # type: ignore[arg-type]
        if marked is _UNMARKED:
            raise KeyError("tensor is not marked")
        return marked  # type: ignore[return-value]

    def __len__(self) -> int:
        self._forget_expired()
        return len(self._by_data) + len(self._by_identity)

    def _forget_expired(self) -> None:
        expired = [key for key, (reference, _) in self._by_data.items() if reference.expired()]
        for key in expired:
            del self._by_data[key]


_UNMARKED = object()

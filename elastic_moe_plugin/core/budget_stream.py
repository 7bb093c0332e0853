"""κ's counter-based stream: every draw addressed by (stream seed, draw counter, token shard).

One draw is one elastic router call on one rank: κ [T] for the T tokens the rank routes, on the host::

    key      = seed + 2^64 · shard                       (128 bits; seed, shard < 2^64)
    block_j  = Philox4x64-10(key, counter · 2^64 + j)    (j = 1, 2, ...: four 64-bit words x each)
    u_t      = (x_t >> 11) · 2^-53                        (t = 0..T-1, the t-th word; u_t in [0, 1))
    κ        = BudgetSchedule.budgets_from_uniforms(u, sampling)
    counter  ← counter + 1                                (whatever T, T = 0 included)

Philox4x64-10 (Salmon et al., SC'11) is numpy's ``numpy.random.Philox``; ``Generator.random``
forms ``u`` exactly as written. The doors' guarantees rest on what this gives
(``docs/parallelism.md#randomness``): O(T) work on every rank whatever the number of shards; ranks
in step whatever their T; no two draws or shards share uniforms, while tensor-parallel peers that
pass the same shard draw the same κ; token t's uniform does not depend on T; the same κ on every
device type.

Where the stream lives (:class:`StreamHome`) is where the door's framework saves and restores RNG
state: a named entry of Megatron's RNG tracker (:class:`TrackedStream`), or one stream per
process that the transformers door saves with the Trainer's RNG files (:class:`ProcessStream`).
Either draws the same way (:meth:`StreamHome.draw`): read the stream, take the draw from a block of
up to 64 draws made ahead (:class:`_DrawsAhead`: one numpy call maps a whole block, where one draw
at a time runs between the model's kernels with cold caches), store the advanced stream. κ reaches
a CUDA device by one non-blocking copy from pinned memory; Σκ and κ's histogram stay known on the
host (:class:`BudgetDraw`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from elastic_moe_plugin.core.schedule import BUDGET_SEED_OFFSET, BudgetSchedule, SamplingMode

_WORD = 1 << 64


@dataclasses.dataclass(frozen=True)
class BudgetDraw:
    """One draw's budgets, on the device and on the host.

    Attributes:
        budgets: κ [T] (int64) on the requested device (the host tensor itself on a CPU device).
        host_budgets: κ [T] (int64, numpy) on the host; read it freely, it costs no device sync.
        total: Σκ, a host int: the (token, expert) pairs the draw dispatches before capacity drops.
            Known without reading the device (for sizing shapes that follow κ).
        counts: the κ histogram [high + 1] (int64, numpy; index = κ) of a schedule on
            {low..high}, or None (a static schedule); the routing records add it up on the host.
    """

    budgets: torch.Tensor
    host_budgets: np.ndarray
    total: int
    counts: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class BudgetStream:
    """The state of κ's stream: ``seed`` (< 2^64) and the ``counter`` of the next draw (>= 0).

    Immutable: :meth:`draw` returns the advanced stream, so an adapter replaces its stored state
    rather than mutating it (a recompute snapshot holding the old state then replays exactly).
    """

    seed: int
    counter: int = 0

    def __post_init__(self) -> None:
        _check_index("BudgetStream.seed", self.seed)
        _check_index("BudgetStream.counter", self.counter)

    @classmethod
    def seeded(cls, seed: int) -> BudgetStream:
        """A fresh stream (counter 0) for any integer seed, reduced modulo 2^64."""
        return cls(int(seed) % _WORD, 0)

    # ------------------------------------------------------------------ the draw
    def uniforms(self, shard: int, num_tokens: int) -> np.ndarray:
        """u [T] float64 in [0, 1) of this stream's current draw on token shard ``shard`` (the
        module docstring's formula); the stream itself does not advance."""
        _check_index("shard", shard)
        _check_index("num_tokens", num_tokens)
        uniforms = np.empty(num_tokens, dtype=np.float64)
        _philox(self.seed, shard).at_counter(self.counter).random(out=uniforms)
        return uniforms

    def draw(
        self,
        schedule: BudgetSchedule,
        sampling: SamplingMode,
        shard: int,
        num_tokens: int,
        device: torch.device | str = "cpu",
    ) -> tuple[BudgetDraw, BudgetStream]:
        """κ [T] of the current draw on ``shard``, and the stream advanced by one draw.

        A static schedule generates no uniforms (κ ≡ k) but advances the counter all the same, so
        ranks stay in step. The device copy is non-blocking from pinned memory on CUDA, none on
        the CPU (:func:`to_device`). One draw on its own; a :class:`StreamHome` draws the same κ
        from blocks made ahead.
        """
        _check_index("shard", shard)
        _check_index("num_tokens", num_tokens)
        if schedule.is_static:
            drawn = _static_draw(schedule, num_tokens)
        else:
            drawn = _DrawsAhead(self.seed, shard, self.counter, 1, num_tokens).draw(
                self.counter, num_tokens, schedule, sampling
            )
        return _on_device(drawn, device), self.advanced()

    def advanced(self) -> BudgetStream:
        """This stream one draw on (counter + 1 modulo 2^64), without re-validating the seed."""
        stream = object.__new__(BudgetStream)
        object.__setattr__(stream, "seed", self.seed)
        object.__setattr__(stream, "counter", (self.counter + 1) % _WORD)
        return stream

    # ------------------------------------------------------------------ as an RNG-state tensor
    def to_state_tensor(self) -> torch.Tensor:
        """The stream as the 16-byte state of a CUDA Philox generator: uint8 [16] on the CPU, bytes
        0-7 the seed, 8-15 the offset ``4 · counter`` (little-endian; CUDA generators need offsets
        that are multiples of 4). Megatron converts its tracker states between such tensors and
        ``torch.Generator`` objects (checkpoint load under CUDA graphs), so the stream survives
        either form; :meth:`from_state` reads both."""
        raw = self.seed.to_bytes(8, "little") + (4 * self.counter).to_bytes(8, "little")
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8)  # owns its bytes; cheaper than a list of ints

    @classmethod
    def from_state(cls, state: torch.Tensor | torch.Generator) -> BudgetStream:
        """The stream of :meth:`to_state_tensor`'s tensor, or of a CUDA generator holding it.

        Raises:
            ValueError: ``state`` is not such a 16-byte state.
        """
        if isinstance(state, torch.Generator):
            state = state.get_state()
        raw = state.detach().cpu().numpy().tobytes() if isinstance(state, torch.Tensor) else b""
        if len(raw) != 16:
            raise ValueError(f"a κ stream state is a 16-byte tensor (seed, 4·counter), got {len(raw)} bytes.")
        offset = int.from_bytes(raw[8:], "little")
        if offset % 4:
            raise ValueError(f"a κ stream state has an offset 4·counter, got {offset}.")
        return cls(int.from_bytes(raw[:8], "little"), offset // 4)


def _check_index(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _WORD:
        raise ValueError(f"{name}={value!r} is invalid: expected an integer in [0, 2^64).")


# ---------------------------------------------------------------------------------- the draws
class _Philox:
    """numpy's Philox4x64-10 under one key, re-aimed at a draw's counter by setting its state
    (cheaper than constructing a generator from Python ints for every draw of a block)."""

    __slots__ = ("bits", "generator", "key_words")

    def __init__(self, key: int) -> None:
        self.bits = np.random.Philox(key=key)
        self.generator = np.random.Generator(self.bits)
        self.key_words = np.array([key & (_WORD - 1), key >> 64], dtype=np.uint64)

    def at_counter(self, counter: int) -> np.random.Generator:
        """The generator whose next words are ``Philox4x64-10(key, counter·2^64 + j)``, j = 1, 2, ...
        (the module docstring's blocks; the 256-bit counter counter·2^64 as four little-endian
        64-bit words, with an empty output buffer)."""
        counter_words = np.array([0, counter, 0, 0], dtype=np.uint64)
        state: Any = {**_EMPTY_PHILOX_BUFFER, "state": {"counter": counter_words, "key": self.key_words}}
        self.bits.state = state  # numpy reads the mapping it documents; its stubs want a TypedDict
        return self.generator


#: the rest of a Philox state: an empty output buffer, so the next words come from the counter
_EMPTY_PHILOX_BUFFER = dict(
    bit_generator="Philox", buffer=np.zeros(4, dtype=np.uint64), buffer_pos=4, has_uint32=0, uinteger=0
)


def _philox(seed: int, shard: int) -> _Philox:
    return _Philox(seed + (shard << 64))


def _static_draw(schedule: BudgetSchedule, num_tokens: int) -> BudgetDraw:
    host = np.full(num_tokens, schedule.low, dtype=np.int64)
    return BudgetDraw(torch.from_numpy(host), host, num_tokens * schedule.low)


def _on_device(drawn: BudgetDraw, device: torch.device | str) -> BudgetDraw:
    if getattr(device, "type", device) == "cpu":
        return drawn
    return dataclasses.replace(drawn, budgets=_host_tensor_to_device(drawn.budgets, torch.device(device)))


def _histograms(budgets: np.ndarray, bins: int) -> np.ndarray:
    """κ's histogram per row of ``budgets`` [depth, T]: [depth, bins], in one bincount (row i's κ
    counted in bins [i·bins, (i+1)·bins))."""
    depth = budgets.shape[0]
    offsets = (np.arange(depth, dtype=np.int64) * bins)[:, None]
    return np.bincount((budgets + offsets).ravel(), minlength=depth * bins).reshape(depth, bins)


class _DrawsAhead:
    """Up to :data:`AHEAD_DRAWS` consecutive draws of one (seed, shard) key, made together: their
    uniforms, and their κ under each (schedule, sampling) that asked for them, as finished CPU draws.

    A row is the draw itself: row i is the uniforms of counter ``first + i`` at the block's width,
    and a draw of T <= width tokens has the first T of them (token t's uniform does not depend on
    T). iid κ maps token by token, so a shorter draw's κ is the first T of the mapped row; balanced
    κ ranks all T uniforms together, so a shorter draw is mapped on its own from the row's first T.
    Rows are read-only by contract: a draw's κ, numpy and CPU tensor, is a view of one.
    """

    __slots__ = ("first", "mapped", "philox", "seed", "shard", "uniforms")

    def __init__(
        self, seed: int, shard: int, first: int, depth: int, width: int, philox: _Philox | None = None
    ) -> None:
        self.seed, self.shard, self.first = seed, shard, first
        self.uniforms = np.empty((depth, width), dtype=np.float64)
        #: the generator of this (seed, shard) key, handed on to the next block of the same key
        self.philox = philox if philox is not None else _philox(seed, shard)
        for row in range(depth):
            self.philox.at_counter(first + row).random(out=self.uniforms[row])
        #: [(schedule, sampling, the draw of each row at the full width)], one entry per distinct
        #: (schedule, sampling) that asked: a model's layers may differ
        self.mapped: list[tuple[BudgetSchedule, str, tuple[BudgetDraw, ...]]] = []

    def holds(self, seed: int, shard: int, counter: int, num_tokens: int) -> bool:
        depth, width = self.uniforms.shape
        return (seed, shard) == (self.seed, self.shard) and 0 <= counter - self.first < depth and num_tokens <= width

    def draw(self, counter: int, num_tokens: int, schedule: BudgetSchedule, sampling: SamplingMode) -> BudgetDraw:
        """Draw ``counter`` of T tokens (:meth:`holds` it), its κ a CPU tensor."""
        row, bins = counter - self.first, schedule.high + 1
        if num_tokens < self.uniforms.shape[1] and sampling == "balanced":
            budgets = schedule.budgets_from_uniforms(self.uniforms[row, :num_tokens], sampling)
            return BudgetDraw(
                torch.from_numpy(budgets), budgets, num_tokens * schedule.center, np.bincount(budgets, minlength=bins)
            )
        drawn = self._mapped(schedule, sampling)[row]
        if num_tokens == self.uniforms.shape[1]:
            return drawn
        budgets = drawn.host_budgets[:num_tokens]
        counts = np.bincount(budgets, minlength=bins)
        return BudgetDraw(drawn.budgets[:num_tokens], budgets, int(counts @ np.arange(bins, dtype=np.int64)), counts)

    def _mapped(self, schedule: BudgetSchedule, sampling: SamplingMode) -> tuple[BudgetDraw, ...]:
        for mapped_schedule, mapped_sampling, draws in self.mapped:
            # equal, not only the same object: every layer resolves its own copy of one schedule,
            # and 48 layers must not map (and keep) 48 copies of a block
            if mapped_sampling == sampling and (mapped_schedule is schedule or mapped_schedule == schedule):
                return draws
        if sampling == "balanced":
            budgets = np.stack([schedule.budgets_from_uniforms(row, sampling) for row in self.uniforms])
        else:
            budgets = schedule.budgets_from_uniforms(self.uniforms, sampling)  # [depth, width]
        counts = _histograms(budgets, schedule.high + 1)
        totals = (counts @ np.arange(schedule.high + 1, dtype=np.int64)).tolist()
        rows = zip(torch.from_numpy(budgets).unbind(0), budgets, totals, counts, strict=True)
        draws = tuple(BudgetDraw(*row) for row in rows)
        self.mapped.append((schedule, sampling, draws))
        return draws


AHEAD_DRAWS = 64  # draws generated together: two layers x two micro-batches use 4 per step
AHEAD_ELEMENTS = 1 << 18  # uniforms per block at most (2 MiB, plus 2 MiB of κ per schedule)


def _next_block(block: _DrawsAhead | None, seed: int, shard: int, counter: int, num_tokens: int) -> _DrawsAhead:
    """The block holding draw ``counter`` of T tokens: ``block`` if it does, else a new one.

    A new block starts at ``counter``; a draw behind the current block (activation recompute
    replays earlier counters) gets a one-draw block of its own, and the caller keeps the current
    block for the draws ahead (:meth:`StreamHome.draw`).
    """
    width, philox = num_tokens, None
    if block is not None and block.seed == seed and block.shard == shard:
        if block.holds(seed, shard, counter, num_tokens):
            return block
        if counter < block.first and num_tokens <= block.uniforms.shape[1]:
            return _DrawsAhead(seed, shard, counter, 1, num_tokens, block.philox)
        width, philox = max(num_tokens, block.uniforms.shape[1]), block.philox
    depth = max(1, min(AHEAD_DRAWS, AHEAD_ELEMENTS // max(width, 1), _WORD - counter))
    return _DrawsAhead(seed, shard, counter, depth, width, philox)


# ---------------------------------------------------------------------------------- where it lives
class StreamHome:
    """Where a door keeps κ's stream: :meth:`load` and :meth:`store` a :class:`BudgetStream`, and
    :meth:`draw` from it. One home serves every router of a process (or of a tracker), so its
    block of draws made ahead follows the stream's counter across layers."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._block: _DrawsAhead | None = None

    def load(self) -> BudgetStream:
        raise NotImplementedError

    def store(self, stream: BudgetStream, replaces: BudgetStream) -> None:
        """Store ``stream`` as the next state, unless something else replaced ``replaces`` meanwhile."""
        raise NotImplementedError

    def draw(
        self, schedule: BudgetSchedule, sampling: SamplingMode, shard: int, num_tokens: int, device: torch.device | str
    ) -> BudgetDraw:
        """κ [T] of this rank's token shard (on ``device`` and on the host); the stream advances by
        one draw, whatever T (the module docstring)."""
        with self._lock:
            stream = self.load()
            if schedule.is_static:
                drawn = _static_draw(schedule, num_tokens)
            else:
                block = _next_block(self._block, stream.seed, shard, stream.counter, num_tokens)
                if block.uniforms.shape[0] > 1 or self._block is None:
                    self._block = block  # a one-draw block behind the current one is not kept
                drawn = block.draw(stream.counter, num_tokens, schedule, sampling)
            self.store(stream.advanced(), stream)
        return _on_device(drawn, device)


class ProcessStream(StreamHome):
    """One stream per process, seeded from ``seed_source()`` (+ :data:`BUDGET_SEED_OFFSET`) at its
    first draw unless :meth:`replace` set it."""

    def __init__(self, seed_source: Callable[[], int]) -> None:
        super().__init__()
        self._seed_source = seed_source
        self._stream: BudgetStream | None = None

    def load(self) -> BudgetStream:
        with self._lock:
            if self._stream is None:
                self._stream = BudgetStream.seeded(BUDGET_SEED_OFFSET + int(self._seed_source()))
            return self._stream

    def store(self, stream: BudgetStream, replaces: BudgetStream) -> None:
        with self._lock:
            if self._stream is replaces:  # a concurrent re-seed wins
                self._stream = stream

    def replace(self, stream: BudgetStream | None) -> None:
        """Set the stream of the next draw (None: seed anew from ``seed_source()`` at the next draw)."""
        with self._lock:
            self._stream = stream


class TrackedStream(StreamHome):
    """The stream as one named entry of an RNG-state tracker, whose ``states_`` dict (or
    ``get_states()`` / ``set_states()``) maps names to uint8 state tensors or ``torch.Generator``
    objects (Megatron's CUDA RNG tracker): whatever saves, restores or snapshots the tracker's
    states carries κ's stream with them. The entry is the 16-byte state of a CUDA Philox generator
    (:meth:`BudgetStream.to_state_tensor`), of the kind the other states are; a draw replaces it,
    never mutates it, so a snapshot taken before keeps the old stream.

    Args:
        bind_tracker: returns the function that returns the tracker (called once, at the first use).
        name: the entry's name.
        seed_source: the seed of a newly registered stream (:data:`BUDGET_SEED_OFFSET` included).
        logger: where a saved entry that is no stream state is reported.
    """

    def __init__(
        self,
        bind_tracker: Callable[[], Callable[[], Any]],
        name: str,
        seed_source: Callable[[], int],
        logger: logging.Logger,
    ) -> None:
        super().__init__()
        self._bind_tracker = bind_tracker
        self._get_tracker: Callable[[], Any] | None = None
        self.name = name
        self._seed_source = seed_source
        self._logger = logger
        # the entry this process stored last and its stream: consecutive draws skip decoding it
        self._last_entry: Any = None
        self._last_stream: BudgetStream | None = None
        self._entries_ahead = _EntriesAhead()

    def tracker(self) -> Any:
        """The tracker now (Megatron may replace it: looked up at every use)."""
        if self._get_tracker is None:
            self._get_tracker = self._bind_tracker()
        return self._get_tracker()

    def states(self) -> dict:
        """The tracker's states without copying them (its ``states_`` dict; ``get_states()`` copies)."""
        tracker = self.tracker()
        states = getattr(tracker, "states_", None)
        return states if isinstance(states, dict) else tracker.get_states()

    def register(self) -> None:
        """A fresh stream (counter 0, ``seed_source()``) unless the tracker holds one."""
        if self.name not in self.tracker().get_states():
            self.store(BudgetStream.seeded(self._seed_source()), None)

    def load(self) -> BudgetStream:
        entry = self.states().get(self.name)
        if entry is not None and entry is self._last_entry and self._last_stream is not None:
            return self._last_stream
        if entry is not None:
            try:
                return BudgetStream.from_state(entry)
            except ValueError as error:  # e.g. a checkpoint of a version that kept a generator state here
                self._logger.warning(
                    "elastic-moe: the saved κ stream %r is not a stream state (%s); starting a fresh one from seed %d.",
                    self.name,
                    error,
                    self._seed_source(),
                )
        stream = BudgetStream.seeded(self._seed_source())
        self.store(stream, None)
        return stream

    def store(self, stream: BudgetStream, replaces: BudgetStream | None) -> None:
        tracker = self.tracker()
        states = getattr(tracker, "states_", None)
        if isinstance(states, dict):
            entry = self._entry(stream, states)
            states[self.name] = entry  # what the tracker's own fork() does with its states
        else:
            states = tracker.get_states()
            entry = self._entry(stream, states)
            tracker.set_states({**states, self.name: entry})
        self._last_entry, self._last_stream = entry, stream

    def forget(self) -> None:
        """Drop the entry: the next draw or :meth:`register` seeds a fresh stream."""
        tracker = self.tracker()
        states = tracker.get_states()
        if self.name in states:
            tracker.set_states({name: value for name, value in states.items() if name != self.name})
        self._last_entry = self._last_stream = None

    def _entry(self, stream: BudgetStream, states: dict) -> Any:
        device = self._generator_device(states)
        if device is None:
            return self._entries_ahead.get(stream)
        generator = torch.Generator(device=device)
        generator.set_state(stream.to_state_tensor())
        return generator

    def _generator_device(self, states: dict) -> torch.device | None:
        """The device of the tracker's ``torch.Generator`` states, None when it holds tensors (a
        tracker's states are all of one kind: its first state other than ours decides)."""
        for name, state in states.items():
            if name != self.name:
                return state.device if isinstance(state, torch.Generator) else None
        return None


class _EntriesAhead:
    """The state tensors of the next :data:`AHEAD_DRAWS` counters of one seed, made together (a
    draw stores one per router call). Immutable by contract, as every entry is."""

    __slots__ = ("first", "seed", "tensors")

    def __init__(self) -> None:
        self.seed: int | None = None
        self.first = 0
        self.tensors: tuple[torch.Tensor, ...] = ()

    def get(self, stream: BudgetStream) -> torch.Tensor:
        row = stream.counter - self.first
        if stream.seed != self.seed or not 0 <= row < len(self.tensors):
            self.seed, self.first, row = stream.seed, stream.counter, 0
            last = min(stream.counter + AHEAD_DRAWS, 1 << 62)  # offset 4·counter < 2^64: counter < 2^62
            counters = range(stream.counter, last)
            self.tensors = tuple(BudgetStream(stream.seed, counter).to_state_tensor() for counter in counters)
        return self.tensors[row]


def to_device(host: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """κ [T] (int64 numpy, host) as a tensor on ``device`` without a host sync.

    CPU: the host array itself. CUDA: a non-blocking copy from pinned memory on the current stream
    (torch's caching host allocator reuses the block only once the copy is done). Else ``.to``.
    """
    host_tensor = torch.from_numpy(host)
    device = torch.device(device)
    return host_tensor if device.type == "cpu" else _host_tensor_to_device(host_tensor, device)


def _host_tensor_to_device(host_tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return host_tensor.pin_memory().to(device, non_blocking=True)
    return host_tensor.to(device)


__all__ = ["BudgetDraw", "BudgetStream", "ProcessStream", "StreamHome", "TrackedStream", "to_device"]

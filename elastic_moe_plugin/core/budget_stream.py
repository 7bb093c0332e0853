"""κ's counter-based stream: every draw addressed by (stream seed, draw counter, token shard).

One draw is one elastic router call on one rank: T budgets κ [T] for the T tokens the rank routes.
The adapters keep the stream state, a :class:`BudgetStream` ``(seed, counter)``, where their
framework saves and restores RNG state (a named state of Megatron's RNG tracker,
:mod:`elastic_moe_plugin.mcore.budget_rng`; the Trainer's ``rng_state`` files,
:mod:`elastic_moe_plugin.hf.budget_rng`), and tell it which token shard the rank holds.

The draw (:meth:`BudgetStream.draw`), on the host::

    key      = seed + 2^64 · shard                       (128 bits; seed, shard < 2^64)
    block_j  = Philox4x64-10(key, counter · 2^64 + j)    (j = 1, 2, ...: four 64-bit words x each)
    u_t      = (x_t >> 11) · 2^-53                        (t = 0..T-1, the t-th word; u_t in [0, 1))
    κ        = BudgetSchedule.host_budgets_from_uniforms(u, sampling)
    counter  ← counter + 1                                (whatever T, T = 0 included)

Philox4x64-10 (Salmon et al., SC'11, "Parallel random numbers: as easy as 1, 2, 3") is numpy's
``numpy.random.Philox``; ``numpy.random.Generator.random`` forms ``u`` exactly as written. What this
gives, and what the adapters' guarantees rest on (``docs/parallelism.md#randomness``):

- **O(T) on every rank.** A rank generates its own T uniforms only: time and memory do not grow
  with the number of shards (data × context × sequence parallel size).
- **In step whatever T.** The counter advances by 1 per draw on every rank, so ranks with
  different T (padding-free batches, uneven context-parallel chunks, a last partial batch) keep
  identical stream states, and one saved state restores every rank.
- **No two draws share uniforms.** Philox is a bijection of the counter for each key: two shards
  (different keys) or two draws (counter ranges ``[c·2^64 + 1, c·2^64 + ⌈T/4⌉]``, disjoint while
  T < 2^66) never produce the same words from the same (key, counter) pair. Tensor-parallel peers
  holding the same tokens pass the same shard, hence draw the same κ.
- **Token t's uniform does not depend on T.** ``u_t`` of draw c on shard s is the same whether the
  shard holds T = t + 1 tokens or more: iid κ_t depends on (seed, c, s, t) only.
- **The same κ on every device type.** κ is computed on the CPU and copied to the device; a GPU
  run and a CPU run with the same seed draw the same κ.

Cost on the host at T = 8192: about 60 µs for the uniforms, 20 µs for the iid mapping, 80 µs for
the balanced one (measured by ``elastic-moe bench --only kappa``). Draws are made up to 64 at a
time, consecutive counters of one (seed, shard), each still exactly its own draw
(:class:`_DrawsAhead`): inside a training step, with the caches cold, one draw at a time cost ten
times its warm cost. To a CUDA device κ travels by one non-blocking copy from pinned memory: no
host sync, no kernel. Σκ, per-token κ and κ's histogram are then known on the host for free:
:class:`BudgetDraw` carries them.
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import torch

from elastic_moe_plugin.core.schedule import BudgetSchedule, SamplingMode

_WORD = 1 << 64

#: the router attribute holding the :class:`BudgetDraw` of its latest draw (both adapters set it)
LATEST_DRAW_ATTR = "_elastic_budget_draw"


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
        for name in ("seed", "counter"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _WORD:
                raise ValueError(f"BudgetStream.{name}={value!r} is invalid: expected an integer in [0, 2^64).")

    @classmethod
    def seeded(cls, seed: int) -> "BudgetStream":
        """A fresh stream (counter 0) for any integer seed, reduced modulo 2^64."""
        return cls(int(seed) % _WORD, 0)

    # ------------------------------------------------------------------ the draw
    def uniforms(self, shard: int, num_tokens: int) -> np.ndarray:
        """u [T] float64 in [0, 1) of this stream's current draw on token shard ``shard`` (the
        module docstring's formula); the stream itself does not advance."""
        _check_index("shard", shard)
        _check_index("num_tokens", num_tokens)
        return _philox_generator(self.seed, shard, self.counter).random(num_tokens)

    def draw(self, schedule: BudgetSchedule, sampling: SamplingMode, shard: int, num_tokens: int,
             device: torch.device | str = "cpu") -> tuple[BudgetDraw, "BudgetStream"]:
        """κ [T] of the current draw on ``shard``, and the stream advanced by one draw.

        A static schedule generates no uniforms (κ ≡ k) but advances the counter all the same, so
        ranks stay in step. The device copy is non-blocking from pinned memory on CUDA, none on
        the CPU (:func:`to_device`).
        """
        _check_index("shard", shard)
        _check_index("num_tokens", num_tokens)
        if schedule.is_static:
            host = np.full(num_tokens, schedule.low, dtype=np.int64)
            drawn, advanced = BudgetDraw(torch.from_numpy(host), host, num_tokens * schedule.low), self.advanced()
        else:
            block = _draws_ahead(self.seed, shard, self.counter, num_tokens)
            drawn, advanced = block.draw(self.counter, num_tokens, schedule, sampling), block.advanced[self.counter - block.first]
        if getattr(device, "type", device) != "cpu":
            drawn = dataclasses.replace(drawn, budgets=_host_tensor_to_device(drawn.budgets, torch.device(device)))
        return drawn, advanced

    def advanced(self) -> "BudgetStream":
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
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8)  # owns its bytes; 3x faster than a list

    @classmethod
    def from_state(cls, state: "torch.Tensor | torch.Generator") -> "BudgetStream":
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


class _PhiloxGenerators(threading.local):
    """One numpy Philox generator per key, per thread, re-aimed at each draw's counter by setting its
    state: constructing ``np.random.Philox(key=..., counter=...)`` from Python ints costs about 3x
    as much (48 against 17 µs inside a router loop on the CI machine), once per router call."""

    def __init__(self) -> None:
        self.by_key: dict[int, tuple[np.random.Philox, np.random.Generator, np.ndarray]] = {}


_GENERATORS = _PhiloxGenerators()
_CACHED_KEYS = 64  # distinct (seed, shard) keys kept per thread; a rank uses one or two


def _philox_generator(seed: int, shard: int, counter: int) -> np.random.Generator:
    """A generator whose next words are ``Philox4x64-10(seed + 2^64·shard, counter·2^64 + j)``,
    j = 1, 2, ... (the module docstring's blocks; what ``np.random.Philox(key=, counter=counter << 64)``
    produces)."""
    key = seed + (shard << 64)
    cached = _GENERATORS.by_key.get(key)
    if cached is None:
        if len(_GENERATORS.by_key) >= _CACHED_KEYS:
            _GENERATORS.by_key.clear()
        bits = np.random.Philox(key=key)
        key_words = np.array([key & (_WORD - 1), key >> 64], dtype=np.uint64)
        cached = _GENERATORS.by_key[key] = (bits, np.random.Generator(bits), key_words)
    bits, generator, key_words = cached
    # the 256-bit counter counter·2^64 as four little-endian 64-bit words; an empty output buffer
    bits.state = {"bit_generator": "Philox", "state": {"counter": np.array([0, counter, 0, 0], dtype=np.uint64),
                                                       "key": key_words},
                  "buffer": np.zeros(4, dtype=np.uint64), "buffer_pos": 4, "has_uint32": 0, "uinteger": 0}
    return generator


class _DrawsAhead:
    """Up to :data:`_AHEAD_DRAWS` consecutive draws of one (seed, shard) key, made together: their
    uniforms, and their κ under each schedule that asked for them, as finished CPU draws.

    Why ahead. One draw is a few microseconds of numpy when its code is warm, but a router call
    runs it between the model's own kernels, with the interpreter's and numpy's caches cold: ten
    times as long there (about 270 µs per draw inside a Megatron MoE layer's forward at T = 256 on
    the CI machine, against 18 µs in a loop of draws). Making the next draws in one loop, and
    mapping them to κ with one numpy call, pays the warm cost once per block.

    What a row holds is the draw itself, not an approximation of it: row i is the uniforms of
    counter ``first + i`` at the block's width, and the uniforms of a draw of T <= width tokens are
    the first T of the row (token t's uniform does not depend on T: the module docstring). iid κ
    maps token by token, so the first T entries of a mapped row are the κ of the shorter draw;
    balanced κ ranks all T uniforms together and is mapped per draw from the row's first T.

    Rows are read-only by contract: a draw's κ, numpy and CPU tensor, is a view of one.
    """

    __slots__ = ("first", "uniforms", "advanced", "mapped")

    def __init__(self, seed: int, shard: int, first: int, depth: int, width: int) -> None:
        self.first = first
        self.uniforms = np.empty((depth, width), dtype=np.float64)
        for row in range(depth):
            _philox_generator(seed, shard, first + row).random(out=self.uniforms[row])
        #: the stream after draw ``first + i``
        self.advanced = tuple(BudgetStream(seed, first + row).advanced() for row in range(depth))
        #: [(schedule, the iid draw of each row at the full width)], one entry per distinct schedule
        #: that asked (a model's layers may differ)
        self.mapped: list[tuple[BudgetSchedule, tuple[BudgetDraw, ...]]] = []

    def holds(self, counter: int, num_tokens: int) -> bool:
        return 0 <= counter - self.first < self.uniforms.shape[0] and num_tokens <= self.uniforms.shape[1]

    def draw(self, counter: int, num_tokens: int, schedule: BudgetSchedule, sampling: SamplingMode) -> BudgetDraw:
        """Draw ``counter`` of T tokens (:meth:`holds` it), its κ a CPU tensor."""
        row, bins = counter - self.first, schedule.high + 1
        if sampling == "balanced":
            budgets = schedule.host_budgets_from_uniforms(self.uniforms[row, :num_tokens], sampling)
            return BudgetDraw(torch.from_numpy(budgets), budgets, num_tokens * schedule.center,
                              np.bincount(budgets, minlength=bins))
        for mapped_schedule, draws in self.mapped:
            # equal, not only the same object: every layer resolves its own copy of one schedule,
            # and 48 layers must not map (and keep) 48 copies of a block
            if mapped_schedule is schedule or mapped_schedule == schedule:
                break
        else:
            budgets = schedule.host_budgets_from_uniforms(self.uniforms, sampling)  # [depth, width]
            depth = budgets.shape[0]
            # every row's histogram in one bincount: row i's κ counted in bins [i·bins, (i+1)·bins)
            offsets = (np.arange(depth, dtype=np.int64) * bins)[:, None]
            counts = np.bincount((budgets + offsets).ravel(), minlength=depth * bins).reshape(depth, bins)
            totals = (counts @ np.arange(bins, dtype=np.int64)).tolist()
            draws = tuple(BudgetDraw(*row_draw) for row_draw in
                          zip(torch.from_numpy(budgets).unbind(0), budgets, totals, counts))
            self.mapped.append((schedule, draws))
        drawn = draws[row]
        if num_tokens == self.uniforms.shape[1]:
            return drawn
        budgets = drawn.host_budgets[:num_tokens]
        counts = np.bincount(budgets, minlength=bins)
        return BudgetDraw(drawn.budgets[:num_tokens], budgets, int(counts @ np.arange(bins, dtype=np.int64)), counts)


class _DrawsAheadByKey(threading.local):
    def __init__(self) -> None:
        self.by_key: dict[int, _DrawsAhead] = {}


_AHEAD = _DrawsAheadByKey()
_AHEAD_DRAWS = 64  # draws generated together: two layers x two micro-batches use 4 per step
_AHEAD_ELEMENTS = 1 << 18  # uniforms per block at most (2 MiB, plus 2 MiB of κ per schedule)
_AHEAD_KEYS = 8  # blocks kept per thread (a rank draws on one or two keys): 32 MiB at most


def _draws_ahead(seed: int, shard: int, counter: int, num_tokens: int) -> _DrawsAhead:
    """The block holding draw ``counter`` of T tokens on this key: the cached one, or a new one.

    A new block starts at ``counter``, except for a draw behind the cached block (activation
    recompute replays earlier counters), which gets a one-draw block of its own and leaves the
    cached block in place for the draws ahead.
    """
    key = seed + (shard << 64)
    cached = _AHEAD.by_key.get(key)
    if cached is not None and cached.holds(counter, num_tokens):
        return cached
    width = num_tokens if cached is None else max(num_tokens, cached.uniforms.shape[1])
    if cached is not None and counter < cached.first and num_tokens <= cached.uniforms.shape[1]:
        return _DrawsAhead(seed, shard, counter, 1, num_tokens)
    depth = max(1, min(_AHEAD_DRAWS, _AHEAD_ELEMENTS // max(width, 1), _WORD - counter))
    if len(_AHEAD.by_key) >= _AHEAD_KEYS:
        _AHEAD.by_key.clear()
    block = _AHEAD.by_key[key] = _DrawsAhead(seed, shard, counter, depth, width)
    return block


def to_device(host: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """κ [T] (int64 numpy, host) as a tensor on ``device`` without a host sync.

    CPU: the host array itself (no copy). CUDA: copied from pinned memory with a non-blocking copy,
    ordered on the current stream; the pinned block is freed to torch's caching host allocator,
    which reuses it only once that copy has completed. Other accelerators: a plain ``.to(device)``.
    """
    host_tensor = torch.from_numpy(host)
    device = torch.device(device)
    return host_tensor if device.type == "cpu" else _host_tensor_to_device(host_tensor, device)


def _host_tensor_to_device(host_tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return host_tensor.pin_memory().to(device, non_blocking=True)
    return host_tensor.to(device)


def latest_draw(router) -> BudgetDraw | None:
    """The :class:`BudgetDraw` of ``router``'s latest elastic draw (κ and Σκ on the host), None
    before its first one or for a router that draws no κ (top-p mode). Not used for routing yet."""
    return router.__dict__.get(LATEST_DRAW_ATTR)


def _check_index(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _WORD:
        raise ValueError(f"{name}={value!r} is invalid: expected an integer in [0, 2^64).")


__all__ = ["LATEST_DRAW_ATTR", "BudgetDraw", "BudgetStream", "latest_draw", "to_device"]

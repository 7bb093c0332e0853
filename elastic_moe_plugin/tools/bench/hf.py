"""Transformers scenarios of ``elastic-moe bench``: one sparse MoE block, stock against elastic, per
experts implementation.

The block is transformers' own class (Gemma 4's: transformers' own router and experts in a module of
the bench's, :class:`Gemma4MoE`), built from its config with random weight matrices (N(0, 0.02)):
``OlmoeSparseMoeBlock`` (OLMoE-shaped: E=64, k=8, ``norm_topk_prob=False``),
``Qwen3MoeSparseMoeBlock`` (Qwen3-MoE-shaped: E=128, k=8, ``norm_topk_prob=True``) and
``DeepseekV3MoE`` (DeepSeek-V3's routing: E=64 routed experts in ``n_group=8`` groups of which
each token's ``topk_group=4`` are eligible, k=8, sigmoid scores selected with
``e_score_correction_bias`` (drawn N(0, 0.02), as a trained model's is not zero), renormalised,
× ``routed_scaling_factor=2.5``; with its one shared expert of the routed experts' width, which runs
in every variant and whose time the block's includes) and Gemma 4's MoE branch (:class:`Gemma4MoE`:
transformers' ``Gemma4TextRouter`` and ``Gemma4TextExperts`` with the layer's norms, E=128, k=8,
softmax then renormalised, × ``per_expert_scale``; Gemma 4 has no MoE block class, so the bench holds
the branch in a module of its own). In the full run they are at the width of OLMoE-1B-7B (H=2048,
F=1024; DeepSeek-V3's block too), Qwen3-30B-A3B (H=2048, F=768) and Gemma 4 26B-A4B (H=2816,
F=704) where stock transformers can train at that width on a CPU (:func:`_sizes`). One block object
serves every variant, so weights and inputs are identical; what changes is the patch:

- ``stock``: ``hf.remove()``, unpatched transformers (static top-k);
- ``iid`` / ``balanced``: ``hf.apply(ElasticConfig(schedule, sampling=...))``.

Each variant runs forward + backward of ``(block(x) * g).sum()`` in training mode, under one
experts implementation (``eager``, ``grouped_mm``, ``batched_mm``). Timing, memory and syncs are
:mod:`.measure`'s. Pairs: expected T·k against the **rows multiplied** by the expert GEMMs in one
forward, read from the GEMMs that run (:class:`ExpertGemmRows`: the routed experts only, not the
shared expert); ``dispatched_pairs`` is Σκ from the routing record of the same forward, so
``realised == dispatched`` says the experts multiplied exactly the kept rows.

The shape line of each table section gives the size measured.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from elastic_moe_plugin.tools.bench.measure import ScenarioResult, Step, VariantResult, measure
from elastic_moe_plugin.tools.bench.schema import BenchRow, Scalar

if TYPE_CHECKING:
    from elastic_moe_plugin.core.schedule import SamplingMode

IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")


@dataclasses.dataclass(frozen=True)
class Size:
    """Hidden width H, expert FFN width F and tokens T of one measured block."""

    hidden: int
    ffn: int
    tokens: int


@dataclasses.dataclass(frozen=True)
class BlockShape:
    """A sparse MoE block to measure: transformers' ``family`` block, its routing shape (E, k, the
    schedule), and its size under each experts implementation."""

    family: str
    experts: int
    topk: int
    schedule: str
    sizes: dict[str, Size]

    def describe(self, implementation: str) -> str:
        size = self.sizes[implementation]
        return f"E={self.experts} k={self.topk} {self.schedule} T={size.tokens} H={size.hidden} F={size.ffn}"


@dataclasses.dataclass(frozen=True)
class _Block:
    """How to build a family's sparse MoE block: its config class (under ``transformers.models``),
    its block (a class under ``transformers.models``, or a builder of the bench's own that takes the
    config: Gemma 4's :class:`Gemma4MoE`), the config fields of the expert FFN width, the expert count
    and k, its ``norm_topk_prob`` (None: the config has none, the router's own rule decides), and any
    other config fields its routing needs."""

    config: str
    block: str | Callable[[Any], torch.nn.Module]
    ffn_field: str
    norm_topk_prob: bool | None
    experts_field: str = "num_experts"
    topk_field: str = "num_experts_per_tok"
    extra: tuple[tuple[str, Any], ...] = ()


class Gemma4MoE(torch.nn.Module):
    """Gemma 4's mixture-of-experts branch, as ``Gemma4TextDecoderLayer.forward`` runs it.

    transformers has no MoE block class for Gemma 4: its router (``Gemma4TextRouter``) and experts
    (``Gemma4TextExperts``) are attributes of the decoder layer, beside a dense MLP whose output
    the layer adds to theirs, so no module of transformers holds the MoE part alone. This one holds
    transformers' own classes under the layer's attribute names (``router``, ``experts``,
    ``pre_feedforward_layernorm_2``, ``post_feedforward_layernorm_2``), built from the same
    ``Gemma4TextConfig``, and its forward is the layer's MoE lines: the router reads the flattened
    residual stream (its own RMS norm, scale and H^-1/2 inside), the experts the
    ``pre_feedforward_layernorm_2``-normed one, and ``post_feedforward_layernorm_2`` norms their
    output. What the layer does besides (attention, the dense MLP and its norms, the residual adds)
    is the same in stock and elastic, and not timed.

    The router is built outside a decoder layer, so the patched ``Gemma4TextDecoderLayer.__init__``
    never tags it with a layer index: its plan resolves without one (a config without ``layers``),
    and its record is keyed 0, its position among the module's routers, as those of the bare
    blocks of the other families are.
    """

    def __init__(self, config: Any) -> None:
        super().__init__()
        modeling = importlib.import_module("transformers.models.gemma4.modeling_gemma4")
        self.router = modeling.Gemma4TextRouter(config)
        self.experts = modeling.Gemma4TextExperts(config)
        self.pre_feedforward_layernorm_2 = modeling.Gemma4RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_feedforward_layernorm_2 = modeling.Gemma4RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, residual: torch.Tensor) -> torch.Tensor:
        """The MoE output [..., H] of the residual stream ``residual`` [..., H] (the layer's ``hidden_states_2``)."""
        hidden_states_flat = residual.reshape(-1, residual.shape[-1])
        _, top_k_weights, top_k_index = self.router(hidden_states_flat)
        hidden_states = self.pre_feedforward_layernorm_2(hidden_states_flat)
        hidden_states = self.experts(hidden_states, top_k_index, top_k_weights)
        return self.post_feedforward_layernorm_2(hidden_states.reshape(residual.shape))


#: DeepSeek-V3's routing: 8 groups of which each token's top 4 are eligible (a 6-10 schedule's widest
#: κ = 10 fits in the 4·E/8 experts of its groups), sigmoid scores renormalised, × 2.5, one shared
#: expert of the routed experts' width in the block
DEEPSEEK_V3_ROUTING: tuple[tuple[str, Any], ...] = (
    ("n_group", 8),
    ("topk_group", 4),
    ("routed_scaling_factor", 2.5),
    ("n_shared_experts", 1),
)

_BLOCKS: dict[str, _Block] = {
    "olmoe": _Block("olmoe.OlmoeConfig", "olmoe.modeling_olmoe.OlmoeSparseMoeBlock", "intermediate_size", False),
    "qwen3_moe": _Block(
        "qwen3_moe.Qwen3MoeConfig", "qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock", "moe_intermediate_size", True
    ),
    "deepseek_v3": _Block(
        "deepseek_v3.DeepseekV3Config",
        "deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE",
        "moe_intermediate_size",
        True,
        experts_field="n_routed_experts",
        extra=DEEPSEEK_V3_ROUTING,
    ),
    # no block class in transformers: the decoder layer's MoE branch, held by the bench (Gemma4MoE)
    "gemma4": _Block(
        "gemma4.Gemma4TextConfig",
        Gemma4MoE,
        "moe_intermediate_size",
        None,  # always renormalised
        topk_field="top_k_experts",
        extra=(("enable_moe_block", True),),
    ),
}


def _sizes(hidden: int, ffn: int) -> dict[str, Size]:
    """The full run's sizes at a model's width (H, F):

    - ``grouped_mm`` (transformers' default): the model's width, 256 tokens;
    - ``batched_mm``: the model's width, 8 tokens: it gathers one [2F, H] and one [H, F] weight
      matrix per row (25 MB per row at OLMoE's width, forward and again for the gradient), the
      small-batch implementation it is;
    - ``eager``: 1/8 of the width, 256 tokens: its backward materialises a full [E, 2F, H] and
      [E, H, F] weight gradient for every expert it indexes (stock behaviour), far too slow a step at
      OLMoE's width on one CPU thread (docs/performance.md).
    """
    return {
        "grouped_mm": Size(hidden, ffn, 256),
        "batched_mm": Size(hidden, ffn, 8),
        "eager": Size(hidden // 8, ffn // 8, 256),
    }


FULL_SHAPES = (  # the widths of OLMoE-1B-7B, Qwen3-30B-A3B, Gemma 4 26B-A4B; DeepSeek-V3's routing at OLMoE's
    BlockShape("olmoe", experts=64, topk=8, schedule="6-10", sizes=_sizes(2048, 1024)),
    BlockShape("qwen3_moe", experts=128, topk=8, schedule="6-10", sizes=_sizes(2048, 768)),
    BlockShape("deepseek_v3", experts=64, topk=8, schedule="6-10", sizes=_sizes(2048, 1024)),
    # google/gemma-4-26B-A4B's config.json: hidden_size 2816, moe_intermediate_size 704, 128 experts, top 8
    BlockShape("gemma4", experts=128, topk=8, schedule="6-10", sizes=_sizes(2816, 704)),
)
_QUICK = {"grouped_mm": Size(128, 64, 128), "batched_mm": Size(128, 64, 32), "eager": Size(128, 64, 128)}
QUICK_SHAPES = (
    BlockShape("olmoe", experts=64, topk=8, schedule="6-10", sizes=_QUICK),
    BlockShape(
        "qwen3_moe",
        experts=128,
        topk=8,
        schedule="6-10",
        sizes={name: dataclasses.replace(size, ffn=48) for name, size in _QUICK.items()},
    ),
    BlockShape("deepseek_v3", experts=64, topk=8, schedule="6-10", sizes=_QUICK),
    BlockShape("gemma4", experts=128, topk=8, schedule="6-10", sizes=_QUICK),
)


@dataclasses.dataclass
class ExpertsVariantResult(VariantResult):
    """A variant of a transformers block: ``realised_pairs`` are the rows the expert GEMMs
    multiplied, ``dispatched_pairs`` the Σκ (stock: T·k) the router dispatched in that forward."""

    dispatched_pairs: int = 0


@dataclasses.dataclass
class ExpertsScenarioResult(ScenarioResult):
    implementation: str = ""

    def rows(self) -> list[BenchRow]:
        """The schema rows; the shape names the experts implementation (a block has one per implementation)."""
        rows = super().rows()
        for item in rows:
            item["shape"] = f"experts_implementation={self.implementation}: {self.shape}"
        return rows


# ------------------------------------------------------------------------------------ counting
class _ExpertWeights(Protocol):
    """What :class:`ExpertGemmRows` reads of a transformers experts module (``block.experts``): plain
    attributes its class and ``use_experts_implementation`` set, which ``nn.Module``'s stubs type as
    ``Tensor | Module``."""

    has_gate: bool
    is_transposed: bool
    hidden_dim: int
    intermediate_dim: int
    gate_up_proj: torch.Tensor
    up_proj: torch.Tensor


class ExpertGemmRows(TorchDispatchMode):
    """Rows multiplied by the GEMMs of ``experts`` while it runs, from their FLOPs.

    Every expert row costs 2·H·N₁ + 2·F·H FLOPs in forward (the gate/up GEMM of width N₁ = 2F
    with a gate, F without, then the down GEMM), whatever the implementation, so
    rows = Σ FLOPs / that. The FLOPs of ``aten.mm`` / ``bmm`` are 2·m·k·n (× batch); those of
    ``aten._grouped_mm`` count the rows below its last offset only (the rows it multiplies).
    """

    def __init__(self, experts: torch.nn.Module) -> None:
        super().__init__()
        weights = cast(_ExpertWeights, experts)
        up = weights.gate_up_proj if weights.has_gate else weights.up_proj  # [E, N1, H] ([E, H, N1] transposed)
        up_width = up.shape[2] if weights.is_transposed else up.shape[1]
        self.flops_per_row = 2 * weights.hidden_dim * up_width + 2 * weights.intermediate_dim * weights.hidden_dim
        self.flops = 0
        self._active = False
        self._handles = [
            experts.register_forward_pre_hook(lambda module, args: self._set(True)),
            experts.register_forward_hook(lambda module, args, out: self._set(False)),
        ]

    def _set(self, active: bool) -> None:
        self._active = active

    @property
    def rows(self) -> int:
        rows, remainder = divmod(self.flops, self.flops_per_row)
        if remainder:
            raise RuntimeError(
                f"expert GEMM FLOPs {self.flops} are not a whole number of rows of "
                f"{self.flops_per_row} FLOPs: a GEMM was counted wrongly"
            )
        return rows

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._active:
            name = func.overloadpacket.__name__
            if name == "mm":
                (m, k), n = args[0].shape, args[1].shape[1]
                self.flops += 2 * m * k * n
            elif name == "bmm":
                (batch, m, k), n = args[0].shape, args[1].shape[2]
                self.flops += 2 * batch * m * k * n
            elif name == "_grouped_mm":
                offsets = kwargs.get("offs", args[2] if len(args) > 2 else None)
                k, n = args[1].shape[-2], args[1].shape[-1]
                self.flops += 2 * int(offsets[-1]) * k * n
        return func(*args, **kwargs)


# ------------------------------------------------------------------------------------ scenario
def _resolve(dotted: str) -> Any:
    module_name, _, attribute = dotted.rpartition(".")
    return getattr(importlib.import_module(f"transformers.models.{module_name}"), attribute)


def build_block(shape: BlockShape, implementation: str) -> torch.nn.Module:
    """The sparse MoE block of ``shape.family`` in training mode (transformers' class, or Gemma 4's
    :class:`Gemma4MoE`), random N(0, 0.02) weight matrices; vectors (norm weights, Gemma 4's router
    scale and ``per_expert_scale``) keep the ones they are built with."""
    spec = _BLOCKS[shape.family]
    size = shape.sizes[implementation]
    routing = dict(spec.extra)
    if spec.norm_topk_prob is not None:
        routing["norm_topk_prob"] = spec.norm_topk_prob
    config = _resolve(spec.config)(
        hidden_size=size.hidden,
        **{spec.experts_field: shape.experts, spec.topk_field: shape.topk, spec.ffn_field: size.ffn},
        **routing,
    )
    config._experts_implementation = implementation
    torch.manual_seed(0)
    block = (_resolve(spec.block) if isinstance(spec.block, str) else spec.block)(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # the experts are torch.empty until a checkpoint loads
        for parameter in block.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, 0.02, generator=generator)
        for name, buffer in block.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a trained model's is not zero: selection ≠ weights
                buffer.normal_(0.0, 0.02, generator=generator)
    return block.train()


@contextlib.contextmanager
def _patch_state_restored() -> Iterator[None]:
    """Whatever the scenarios switch, leave ``hf`` as it was (applied with its config, or not)."""
    from elastic_moe_plugin import hf

    previous = hf.active_config()
    try:
        yield
    finally:
        hf.remove()
        if previous is not None:
            hf.apply(previous)


def block_scenario(shape: BlockShape, implementation: str) -> tuple[dict[str, Step], dict[str, int]]:
    """``{variant: Step}`` over one block and one input ``[1, T, H]``, and the dict in which each
    variant's ``pairs()`` leaves the Σκ its router dispatched in the counted forward."""
    from elastic_moe_plugin import hf
    from elastic_moe_plugin.core.config import ElasticConfig
    from elastic_moe_plugin.hf import budget_rng

    block = build_block(shape, implementation)
    size = shape.sizes[implementation]
    tokens = size.tokens
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(1, tokens, size.hidden, generator=generator)
    grad_out = torch.randn(1, tokens, size.hidden, generator=generator)

    def elastic(sampling: SamplingMode) -> Callable[[], None]:
        def setup() -> None:
            hf.apply(ElasticConfig(schedule=shape.schedule, sampling=sampling))
            # Every run of a variant draws the same κ (κ's own stream, seeded afresh): the eager loop
            # syncs once per expert hit, so a count that moved with the draw would compare nothing.
            torch.manual_seed(0)
            budget_rng.reset()

        return setup

    setups = {"stock": hf.remove, "iid": elastic("iid"), "balanced": elastic("balanced")}
    dispatched: dict[str, int] = {}

    def forward():
        return block(x.detach().requires_grad_())

    def run():
        block.zero_grad(set_to_none=True)
        (forward() * grad_out).sum().backward()

    def counted_rows(name: str):
        def rows() -> int:
            experts = block.experts
            assert isinstance(experts, torch.nn.Module)  # a sparse MoE block's experts are a module
            with ExpertGemmRows(experts) as counted, torch.no_grad():
                forward()
            record = hf.routing_records(block).get(0) if name != "stock" else None
            dispatched[name] = int(record.budgets.sum()) if record is not None else tokens * shape.topk
            return counted.rows

        return rows

    steps = {
        name: Step(run=run, forward=forward, pairs=counted_rows(name), setup=setup) for name, setup in setups.items()
    }
    return steps, dispatched


def measure_block(shape: BlockShape, implementation: str, warmup: int, repeats: int) -> ExpertsScenarioResult:
    """One block under one experts implementation: stock, iid and balanced, interleaved."""
    steps, dispatched = block_scenario(shape, implementation)
    with _patch_state_restored():
        measured = measure(f"{shape.family}-block", shape.describe(implementation), steps, warmup, repeats)
    size = shape.sizes[implementation]
    params: dict[str, Scalar] = dict(
        family=shape.family, implementation=implementation, experts=shape.experts, topk=shape.topk,
        schedule=shape.schedule, tokens=size.tokens, hidden=size.hidden, ffn=size.ffn,
    )  # fmt: skip
    result = ExpertsScenarioResult(
        scenario=measured.scenario, shape=measured.shape, implementation=implementation, params=params, mode="hf"
    )
    for name, variant in measured.variants.items():
        result.variants[name] = ExpertsVariantResult(**dataclasses.asdict(variant), dispatched_pairs=dispatched[name])
    return result


def run_suite(quick: bool, threads: int) -> list[ExpertsScenarioResult]:
    """Every block under every experts implementation."""
    import os

    os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
    if threads:
        torch.set_num_threads(threads)
    # --quick (CI: the figures and the exact pair counts of every block, not its timing) times 3 rounds
    shapes, (warmup, repeats) = (QUICK_SHAPES, (1, 3)) if quick else (FULL_SHAPES, (2, 11))
    return [
        measure_block(shape, implementation, warmup, repeats) for shape in shapes for implementation in IMPLEMENTATIONS
    ]


__all__ = [
    "DEEPSEEK_V3_ROUTING",
    "FULL_SHAPES",
    "IMPLEMENTATIONS",
    "QUICK_SHAPES",
    "BlockShape",
    "ExpertGemmRows",
    "ExpertsScenarioResult",
    "ExpertsVariantResult",
    "Gemma4MoE",
    "Size",
    "block_scenario",
    "build_block",
    "measure_block",
    "run_suite",
]

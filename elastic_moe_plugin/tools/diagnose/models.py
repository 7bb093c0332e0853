"""Loaded checkpoints behind one interface: a forward that also returns every MoE layer's router logits.

:class:`RoutedModel` gives logits [B, S, V] and, on request, {layer: router logits [B·S, E]}
(batch-major rows, whatever the framework's layout), the router's distribution over all E
experts, and a static top-k override for the inference sweep. :class:`HFRoutedModel` wraps a
transformers checkpoint (routers of the families :mod:`elastic_moe_plugin.hf` covers);
:class:`MegatronDemoModel` an ``elastic-moe demo`` ``GPTModel``, run by Megatron on the CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any, cast

import torch

from elastic_moe_plugin.core.routing import balancing_scores, score
from elastic_moe_plugin.tools import inference_topk
from elastic_moe_plugin.tools.diagnose.checkpoints import CheckpointSpec
from elastic_moe_plugin.tools.diagnose.errors import DiagnosticsError


@dataclasses.dataclass
class ModelInfo:
    """What ``compare`` needs to know about a checkpoint."""

    label: str
    kind: str  # "hf" | "megatron-demo"
    path: str
    num_layers: int
    moe_layers: tuple[int, ...]
    num_experts: int
    topk: int
    vocab_size: int
    max_positions: int | None
    run: str | None = None

    def describe(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"moe_layers": list(self.moe_layers)}


class RoutedModel:
    """A loaded checkpoint: a forward that also returns each MoE layer's router logits."""

    info: ModelInfo

    def forward(
        self, ids: torch.Tensor, valid: torch.Tensor, capture: bool
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Logits [B, S, V] and, if ``capture``, {layer: router logits [B·S, E]} (batch-major rows)."""
        raise NotImplementedError

    def topk(self, k: int) -> contextlib.AbstractContextManager:
        """Static top-``k`` routing in every MoE layer inside the block (inference only)."""
        raise NotImplementedError

    def router_distribution(self, logits: torch.Tensor) -> torch.Tensor:
        """The router's per-token distribution over all experts: softmax(z) in fp32."""
        return score(logits, "softmax")


class HFRoutedModel(RoutedModel):
    """A transformers MoE checkpoint; routers of the families :mod:`elastic_moe_plugin.hf` covers."""

    def __init__(self, path: str, label: str, dtype: str = "float32") -> None:
        from transformers import AutoModelForCausalLM

        try:
            self.model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
        except (OSError, ValueError) as error:
            raise DiagnosticsError(f"cannot load the transformers checkpoint {path!r}: {error}") from None
        covered = self._find_routers(path)
        #: {layer index: the module whose weights route and whose output is the logits}: the router,
        #: or the router module of a block that routes in a method (DBRX, Jamba 5.19)
        self.routers: dict[int, torch.nn.Module] = {
            layer: cast(torch.nn.Module, router.router) if family.routing_method else router
            for layer, (router, family) in covered.items()
        }
        config = self.model.config
        text = getattr(config, "text_config", None) or config
        first, family = next(iter(covered.values()))
        self.info = ModelInfo(
            label=label,
            kind="hf",
            path=path,
            num_layers=int(text.num_hidden_layers),
            moe_layers=tuple(sorted(self.routers)),
            num_experts=family.num_experts_of(first),
            topk=family.top_k_of(first),
            vocab_size=int(text.vocab_size),
            max_positions=getattr(text, "max_position_embeddings", None),
        )
        self._captured: dict[int, torch.Tensor] | None = None
        for layer, (_, family) in covered.items():
            self.routers[layer].register_forward_hook(self._hook(layer, family.first_output == "probabilities"))

    def _find_routers(self, path: str) -> dict[int, tuple[torch.nn.Module, Any]]:
        """{layer index: (router, its family)} of every covered router (one per layer)."""
        from elastic_moe_plugin import hf
        from elastic_moe_plugin.hf.families import covered_routers, layer_index_from_name

        routers: dict[int, tuple[torch.nn.Module, Any]] = {}
        for name, module, family in covered_routers(self.model):
            layer = layer_index_from_name(name)
            if layer is None:
                raise DiagnosticsError(f"{path}: cannot tell the layer index of router {name!r}.")
            if layer in routers:
                raise DiagnosticsError(
                    f"{path}: layer {layer} holds several routers ({name!r} and another, e.g. ERNIE-4.5-VL's text "
                    f"and vision routers), and the diagnostics compare one router per layer."
                )
            routers[layer] = (module, family)
        if not routers:
            raise DiagnosticsError(
                f"{path} ({type(self.model).__name__}) has no router of a family elastic-moe covers "
                f"({hf.families.family_names()})."
            )
        return routers

    def _hook(self, layer: int, probabilities: bool):
        def hook(module, inputs, output):
            if self._captured is not None:
                logits = output[0] if isinstance(output, tuple) else output
                if probabilities:  # Gemma 4 returns p: log p, whose softmax the readers take, is p again
                    logits = logits.log()
                self._captured[layer] = logits.detach().reshape(-1, logits.shape[-1])

        return hook

    @torch.no_grad()
    def forward(self, ids, valid, capture):
        self._captured = {} if capture else None
        try:
            logits = self.model(input_ids=ids, attention_mask=valid.long(), use_cache=False).logits
            return logits, self._captured or {}
        finally:
            self._captured = None

    def topk(self, k):
        return inference_topk.transformers(self.model, k)


class MegatronDemoModel(RoutedModel):
    """A CPU-demo Megatron ``GPTModel`` (``elastic-moe demo`` output), run by Megatron on the CPU."""

    def __init__(self, out_dir: str, run: str, label: str) -> None:
        from elastic_moe_plugin.tools import demo

        model, config = demo.load_trained(out_dir, run)
        self.model = model.eval()
        from megatron.core.transformer.moe.router import TopKRouter

        self.routers = {int(m.layer_number) - 1: m for m in self.model.modules() if isinstance(m, TopKRouter)}
        transformer = config["transformer_config"]
        self.score_function = next(iter(self.routers.values())).score_function if self.routers else "softmax"
        self.info = ModelInfo(
            label=label,
            kind="megatron-demo",
            path=out_dir,
            run=run,
            num_layers=int(transformer["num_layers"]),
            moe_layers=tuple(sorted(self.routers)),
            num_experts=int(transformer["num_moe_experts"]),
            topk=int(transformer["moe_router_topk"]),
            vocab_size=int(config["gpt_model"]["vocab_size"]),
            max_positions=int(config["gpt_model"]["max_sequence_length"]),
        )
        self._captured: dict[int, torch.Tensor] | None = None
        for layer, router in self.routers.items():
            self._wrap_routing(layer, router)

    def _wrap_routing(self, layer: int, router) -> None:
        # An instance attribute shadows TopKRouter.routing (stock or elastic-patched alike), so the
        # logits are seen exactly as the router's own routing step receives them.
        routing = router.routing

        def capture_routing(logits, *args, **kwargs):
            if self._captured is not None:
                # [S, B, E] (Megatron is sequence-major) -> [B·S, E], batch-major like transformers
                rows = logits.detach().transpose(0, 1) if logits.dim() == 3 else logits.detach()
                self._captured[layer] = rows.reshape(-1, logits.shape[-1])
            return routing(logits, *args, **kwargs)

        router.routing = capture_routing

    @torch.no_grad()
    def forward(self, ids, valid, capture):
        batch, seq = ids.shape
        # explicit causal mask (True = masked): GPTModel's default mask is allocated on "cuda"
        mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
        positions = torch.arange(seq).expand(batch, seq)
        self._captured = {} if capture else None
        try:
            logits = self.model(ids, positions, attention_mask=mask)
            return logits, self._captured or {}
        finally:
            self._captured = None

    def router_distribution(self, logits):
        # softmax, or sigmoid / sqrtsoftplus scores normalised to a distribution: what the aux losses weigh
        return balancing_scores(logits, self.score_function)

    def topk(self, k):
        if not 1 <= k <= self.info.num_experts:
            raise DiagnosticsError(
                f"top-k {k} is invalid for {self.info.label}: it has {self.info.num_experts} experts."
            )
        return inference_topk.megatron(self.model, k)


@contextlib.contextmanager
def megatron_session() -> Iterator[None]:
    """Megatron on the CPU for demo checkpoints: the compatibility layer and model-parallel state
    (TP=PP=EP=1), reusing what the process already has and undoing only what it set up."""
    from elastic_moe_plugin import cpu_runtime

    cpu_runtime.disable_torch_compile()
    # force: a GPU machine still runs the demo's CPU models on the CPU (as ``elastic-moe demo`` does)
    with cpu_runtime.enabled(force=torch.cuda.is_available()):
        from megatron.core import parallel_state

        created = False
        if not parallel_state.model_parallel_is_initialized():
            cpu_runtime.initialize_model_parallel()
            created = True
        try:
            yield
        finally:
            if created:
                cpu_runtime.destroy()


@contextlib.contextmanager
def _quiet_megatron() -> Iterator[None]:
    import logging
    import warnings

    logger = logging.getLogger("megatron")
    level = logger.level
    logger.setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        try:
            yield
        finally:
            logger.setLevel(level)


def load_models(
    specs: Sequence[CheckpointSpec], stack: contextlib.ExitStack, dtype: str = "float32"
) -> list[RoutedModel]:
    """Load every spec; the first demo checkpoint enters :func:`megatron_session` on ``stack``.

    Raises:
        DiagnosticsError: an unloadable checkpoint, or two models with one label.
    """
    models: list[RoutedModel] = []
    session = False
    for spec in specs:
        if spec.kind == "hf":
            models.append(HFRoutedModel(spec.path, spec.label, dtype))
        else:
            if not session:
                stack.enter_context(_quiet_megatron())
                stack.enter_context(megatron_session())
                session = True
            assert spec.run is not None  # a demo checkpoint names its run (parse_checkpoint)
            models.append(MegatronDemoModel(spec.path, spec.run, spec.label))
    labels = [m.info.label for m in models]
    if len(set(labels)) != len(labels):
        raise DiagnosticsError(f"checkpoint labels must differ, got {labels}; name them with LABEL=PATH.")
    return models

"""What defines a demo run: :class:`DemoSettings` (the defaults are ``make demo``), the ``--quick``
overrides and the constants written into the output files.

Light on purpose (no torch, no Megatron): the CLI reads its flag defaults from here.
"""

from __future__ import annotations

import dataclasses

from elastic_moe_plugin.core.errors import ConfigError

#: the corpus seed: fixed, so every run (any --seed) sees the same train and held-out splits
CORPUS_SEED = 20_260_001
#: ``format`` of ``summary.json`` and ``model_config.json`` (the diagnostics recognise demo folders by it)
FORMAT = "elastic-moe-demo/1"
PAPER_NOTE = (
    "The paper's gains (+0.84 / +2.02 Avg(9) points in SFT of OLMoE-1B-7B / Qwen3-30B-A3B, "
    "+1.6 points in from-scratch pretraining) were measured at 1B-30B scale; at this toy size "
    "elastic routing is not expected to beat static top-k, and a single seed decides little."
)
#: the values of ``DemoSettings.device`` (what each means: :mod:`elastic_moe_plugin.tools.demo.device`)
DEVICES = ("cpu", "cuda")


@dataclasses.dataclass(frozen=True)
class DemoSettings:
    """Everything that defines a demo run (the defaults are ``make demo``)."""

    schedule: str = "2-6"
    sigma: float = 1.5
    layers: str | None = None
    num_layers: int = 4
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_experts: int = 16
    topk: int = 4
    expert_ffn_hidden_size: int = 64
    aux_loss_coeff: float = 1e-2
    seq_len: int = 64
    batch_size: int = 32
    steps: int = 500
    lr: float = 3e-3
    seed: int = 0
    eval_points: int = 10
    heldout_sequences: int = 256
    data: str | None = None
    device: str = "cpu"  # "cuda": Megatron's own CUDA path, no CPU runtime (elastic-moe compare --device)

    def __post_init__(self) -> None:
        # whether a CUDA device is there is checked when the runs start (train_runs): a GPU study's
        # settings are read back on CPU machines too (elastic-moe compare --report)
        if self.device not in DEVICES:
            raise ConfigError(
                f"device={self.device!r} is not a device the demo trains on: expected one of "
                f"{', '.join(map(repr, DEVICES))}. Use device='cpu' (--device cpu), or device='cuda' "
                "(--device cuda) on a machine with a CUDA GPU.",
                field="device",
                fixes=({"device": "cpu"},),
            )

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    @property
    def tokens(self) -> int:
        return self.steps * self.tokens_per_step


#: ``--quick``: a smaller batch and fewer steps, for a short run (its duration: docs/performance.md)
QUICK = dict(batch_size=16, steps=60, eval_points=3, heldout_sequences=128)

"""The ``megatron sft`` and Megatron-LM rows of ``elastic-moe bench --only e2e``.

- :class:`MegatronSft`: real ``megatron sft`` (Megatron-SWIFT, mcore-bridge) on one CPU process, as
  ``tests/swift/test_megatron_sft.py`` and ``elastic-moe launch RECIPE --rehearse`` run it: the CPU
  runtime switched on in every process by the child bootstrap
  (:mod:`elastic_moe_plugin.tools.child_bootstrap`, ``megatron_swift``),
  its :data:`~elastic_moe_plugin.cpu_runtime.megatron_swift.CPU_FLAGS`, the plugin file with
  ``--callbacks elastic_moe``; a tiny Qwen3-MoE (2 layers, hidden 64, 16 experts of width 16,
  top-8, renormalised gate) built with the recipes' tiny-asset builders; micro-batch 2 of at most 192
  tokens; ``ELASTIC_MOE_SCHEDULE=static`` against ``6-10``. Steps/s from Megatron-SWIFT's logged
  cumulative ``train_speed(s/it)``, as for ``swift sft``.
- :class:`MegatronLM`: Megatron-LM's trainer (``megatron.training.pretrain``) through the front door
  ``python -m elastic_moe_plugin.megatron_lm --cpu examples/megatron_lm/pretrain_gpt_moe.py`` under
  torchrun (one gloo rank), as ``tests/mcore/test_megatron_lm.py`` runs it: a tiny GPT (2 layers,
  hidden 64, 16 experts of width 32, top-8, alltoall dispatcher, aux loss), mock data, 2 micro-batches
  of 4 x 64 tokens per step, ``--elastic-moe-schedule static`` against ``6-10``. Steps/s from
  Megatron-LM's own ``elapsed time per iteration (ms)``, over the steps after the warm-up. The log
  interval is the pretraining recipe's, 10 (``configs/pretrain/base.yaml``; a logging step is where
  the routing metrics are reported), when the warm-up and the steps are multiples of it, else 1
  (``--quick``): each logged figure is the mean over the iterations since the previous log.
"""

from __future__ import annotations

import itertools
import json
import re
import socket
import sys
from pathlib import Path
from typing import Any, ClassVar

from elastic_moe_plugin.tools.bench import e2e_interleaved
from elastic_moe_plugin.tools.bench.e2e_child import Command, RunReading, child_env, console_script, probe_env
from elastic_moe_plugin.tools.bench.e2e_swift import logged_mean_kappa, read_syncs, steady_steps_per_second

SCHEDULES = ("static", "6-10")
REPO = Path(__file__).resolve().parents[3]
MEGATRON_LM_SCRIPT = REPO / "examples" / "megatron_lm" / "pretrain_gpt_moe.py"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class MegatronSft:
    """``megatron sft`` on a tiny Qwen3-MoE, top-8 of 16 experts: static against elastic 6-10."""

    key, label = "megatron_sft", "megatron sft"
    static, elastic = SCHEDULES
    default_steps, default_warmup = 60, 10  # its steps are short (docs/performance.md): 16 timed ones say little
    interleaves = True  # static and elastic blocks in one process (e2e_interleaved)
    # it logs every step (the recipes' --logging_steps 1), so blocks need not hold whole log
    # intervals; short ones pair steps close in time, where the step time here drifts over a few
    # seconds, in either mode (docs/performance.md)
    interleave_block, interleave_pairs = 5, 8
    timing = "from Megatron-SWIFT's logged cumulative train_speed(s/it)"
    MODEL: ClassVar[dict[str, Any]] = {
        "hidden_size": 64,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 512,
        "router_aux_loss_coef": 0.01,
        "tie_word_embeddings": False,
        "num_experts": 16,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 16,
        "norm_topk_prob": True,
    }
    MICRO_BATCH, MAX_LENGTH = 2, 192

    def __init__(self) -> None:
        self.model_dir: Path | None = None
        self.dataset: Path | None = None

    def describe(self) -> str:
        m = self.MODEL
        return (
            f"Qwen3-MoE, {m['num_hidden_layers']} layers, H={m['hidden_size']}, {m['num_experts']} experts of "
            f"width {m['moe_intermediate_size']}, top-{m['num_experts_per_tok']}, micro-batch {self.MICRO_BATCH} "
            f"x {self.MAX_LENGTH} tokens, 1 CPU rank"
        )

    def prepare(self, work: Path, steps: int) -> None:
        import random

        from elastic_moe_plugin.tools.recipes import tiny_assets

        rng = random.Random(0)
        tokenizer = tiny_assets.train_tokenizer(rng)
        self.model_dir = tiny_assets.write_model(
            work / "qwen3_moe_e16_k8", "qwen3_moe", tokenizer, {**self.MODEL, "vocab_size": tiny_assets.VOCAB}
        )
        rows = tiny_assets.chat_rows(rng, max(64, self.MICRO_BATCH * (steps + 2)))
        self.dataset = tiny_assets.write_chat_dataset(work / "train.jsonl", rows)

    def command(
        self, schedule: str, steps: int, out: Path, sync_step: int, interleave_block: int | None = None
    ) -> Command:
        """One run; with ``interleave_block`` an interleaved one (``schedule`` the elastic one)."""
        from elastic_moe_plugin.cpu_runtime.megatron_swift import CPU_FLAGS
        from elastic_moe_plugin.swift import plugin_path
        from elastic_moe_plugin.tools import child_bootstrap

        startup = child_bootstrap.environment(("megatron_swift", "step_probe"), child_env()["PYTHONPATH"])
        env = child_env(
            **startup,
            NPROC_PER_NODE="1",
            MASTER_PORT=str(_free_port()),
            HF_DATASETS_CACHE=str(out / "hf_datasets"),
            MODELSCOPE_CACHE=str(out / "modelscope"),
            ELASTIC_MOE_SCHEDULE=schedule,
            **probe_env(out, sync_step, "megatron_swift", interleave_block),
        )
        argv = [
            console_script("megatron"),
            "sft",
            "--model",
            str(self.model_dir),
            "--model_type",
            "qwen3_moe",
            "--template",
            "qwen3",
            "--dataset",
            str(self.dataset),
            "--split_dataset_ratio",
            "0",
            "--check_model",
            "false",
            "--external_plugins",
            str(plugin_path()),
            "--callbacks",
            "elastic_moe",
            "--tuner_type",
            "full",
            "--finetune",
            "true",
            "--micro_batch_size",
            str(self.MICRO_BATCH),
            "--global_batch_size",
            str(self.MICRO_BATCH),
            "--max_length",
            str(self.MAX_LENGTH),
            "--truncation_strategy",
            "left",
            "--train_iters",
            str(steps),
            "--logging_steps",
            "1",
            "--lr",
            "1e-4",
            "--moe_aux_loss_coeff",
            "0.01",
            "--clip_grad",
            "1.0",
            "--moe_token_dispatcher_type",
            "alltoall",
            "--dataset_num_proc",
            "1",
            "--dataloader_num_workers",
            "0",
            "--save_steps",
            str(10 * steps),
            "--output_dir",
            str(out / "out"),
            "--add_version",
            "false",
            *[word for flag, (value, _) in CPU_FLAGS.items() for word in (f"--{flag}", value)],
        ]
        return Command(argv, env, out)

    def _logged_rows(self, out: Path) -> list[dict]:
        path = out / "out" / "logging.jsonl"
        if not path.exists():
            raise RuntimeError(f"{path} is missing: megatron sft logged no training step")
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return [row for row in rows if "loss" in row and "iteration" in row and "train_speed(s/it)" in row]

    def read(self, out: Path, output: str, warmup: int) -> RunReading:
        rows = self._logged_rows(out)
        return RunReading(steady_steps_per_second(rows, warmup, "iteration"), logged_mean_kappa(rows), len(rows))

    def read_interleaved(
        self, out: Path, output: str, warmup: int
    ) -> tuple[e2e_interleaved.InterleavedReading, dict[str, float | None]]:
        """The interleaved run's timings, and the mean κ its elastic iterations logged (its stock
        blocks log none)."""
        reading = e2e_interleaved.read(out / "interleaved.json", warmup)
        rows = [
            row
            for row in self._logged_rows(out)  # "iteration": "i/n"
            if int(str(row["iteration"]).split("/")[0]) in reading.elastic_iterations
        ]
        return reading, {"elastic": logged_mean_kappa(rows)}

    def syncs(self, out: Path) -> int | None:
        return read_syncs(out / "syncs.json")


class MegatronLM:
    """Megatron-LM's trainer on a tiny MoE GPT, top-8 of 16 experts: static against elastic 6-10."""

    key, label = "megatron_lm", "Megatron-LM"
    static, elastic = SCHEDULES
    default_steps, default_warmup = 60, 10
    interleaves = True  # static and elastic blocks in one process (e2e_interleaved)
    interleave_block, interleave_pairs = e2e_interleaved.BLOCK, e2e_interleaved.PAIRS
    timing = (
        "from Megatron-LM's logged elapsed time per iteration (ms), logged every 10 iterations as the "
        "pretraining recipe logs (every iteration when the warm-up or the steps are not multiples of 10)"
    )
    #: the pretraining recipe's --log-interval (configs/pretrain/base.yaml)
    RECIPE_LOG_INTERVAL = 10
    LAYERS, HIDDEN, EXPERTS, TOPK, EXPERT_FFN, SEQ, MICRO_BATCH, GLOBAL_BATCH = 2, 64, 16, 8, 32, 64, 4, 8

    def describe(self) -> str:
        return (
            f"GPT, {self.LAYERS} layers, H={self.HIDDEN}, {self.EXPERTS} experts of width {self.EXPERT_FFN}, "
            f"top-{self.TOPK}, alltoall, {self.GLOBAL_BATCH // self.MICRO_BATCH} micro-batches of "
            f"{self.MICRO_BATCH} x {self.SEQ} tokens, 1 gloo rank"
        )

    def prepare(self, work: Path, steps: int) -> None:
        if not MEGATRON_LM_SCRIPT.is_file():
            raise RuntimeError(
                f"{MEGATRON_LM_SCRIPT} is missing: the Megatron-LM row runs the repository's example "
                f"trainer; run the bench from a checkout of elastic-moe-plugin, or pass --launchers "
                f"swift_sft megatron_sft."
            )
        work.mkdir(parents=True, exist_ok=True)

    def log_interval(self, steps: int, warmup: int, interleave_block: int | None = None) -> int:
        """The recipe's log interval when the timed span is whole intervals of it (interleaved:
        when every block holds whole intervals, so that each logs alike), else 1."""
        interval = self.RECIPE_LOG_INTERVAL
        if interleave_block:
            return interval if warmup % interval == 0 and interleave_block % interval == 0 else 1
        return interval if warmup % interval == 0 and steps % interval == 0 and steps > warmup else 1

    def megatron_args(self, steps: int, log_interval: int = 1) -> list[str]:
        return [
            "--num-layers",
            str(self.LAYERS),
            "--hidden-size",
            str(self.HIDDEN),
            "--num-attention-heads",
            "4",
            "--ffn-hidden-size",
            str(2 * self.HIDDEN),
            "--num-experts",
            str(self.EXPERTS),
            "--moe-router-topk",
            str(self.TOPK),
            "--moe-ffn-hidden-size",
            str(self.EXPERT_FFN),
            "--moe-token-dispatcher-type",
            "alltoall",
            "--moe-router-load-balancing-type",
            "aux_loss",
            "--moe-aux-loss-coeff",
            "0.01",
            "--seq-length",
            str(self.SEQ),
            "--max-position-embeddings",
            str(self.SEQ),
            "--micro-batch-size",
            str(self.MICRO_BATCH),
            "--global-batch-size",
            str(self.GLOBAL_BATCH),
            "--train-iters",
            str(steps),
            "--lr",
            "1e-4",
            "--seed",
            "1234",
            "--mock-data",
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            "128",
            "--log-interval",
            str(log_interval),
            "--eval-iters",
            "0",
            "--eval-interval",
            str(10 * steps),
            "--num-workers",
            "0",
            "--hidden-dropout",
            "0",
            "--attention-dropout",
            "0",
            # CPU: gloo, no fused kernels or Transformer Engine; --clip-grad 0 as the tests run --cpu
            "--distributed-backend",
            "gloo",
            "--transformer-impl",
            "local",
            "--use-cpu-initialization",
            "--no-gradient-accumulation-fusion",
            "--no-persist-layer-norm",
            "--no-bias-gelu-fusion",
            "--disable-bias-linear",
            "--clip-grad",
            "0",
        ]

    def command(
        self, schedule: str, steps: int, out: Path, sync_step: int, interleave_block: int | None = None
    ) -> Command:
        """One run; with ``interleave_block`` an interleaved one (``schedule`` the elastic one)."""
        from elastic_moe_plugin.tools import child_bootstrap

        startup = child_bootstrap.environment(("step_probe",), child_env()["PYTHONPATH"])
        env = child_env(
            **startup,
            NO_VCS_VERSION="1",
            **probe_env(out, sync_step, "megatron_lm", interleave_block),
        )
        argv = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "1",
            "-m",
            "elastic_moe_plugin.megatron_lm",
            "--cpu",
            str(MEGATRON_LM_SCRIPT),
            *self.megatron_args(steps, self.log_interval(steps, sync_step, interleave_block)),
            "--elastic-moe-schedule",
            schedule,
        ]
        return Command(argv, env, out)

    @staticmethod
    def _logged(output: str) -> tuple[dict[int, float], dict[int, float]]:
        """({iteration: elapsed ms}, {iteration: logged mean κ}) of the console's iteration lines."""
        elapsed, kappas = {}, {}
        for line in output.splitlines():
            match = re.search(r"\biteration\s+(\d+)/\s*\d+ \|(.*)$", line)
            if not match:
                continue
            iteration, fields = int(match.group(1)), match.group(2)
            time_match = re.search(r"elapsed time per iteration \(ms\): ([\d.]+)", fields)
            if time_match is None:
                raise RuntimeError(f"Megatron-LM logged iteration {iteration} without its elapsed time: {line}")
            elapsed[iteration] = float(time_match.group(1))
            kappa = re.search(r" elastic_moe/mean_kappa: ([^ |]+) \|", fields)
            if kappa:
                kappas[iteration] = float(kappa.group(1))
        return elapsed, kappas

    def read_interleaved(
        self, out: Path, output: str, warmup: int
    ) -> tuple[e2e_interleaved.InterleavedReading, dict[str, float | None]]:
        """The interleaved run's timings, and the mean κ its elastic iterations logged (its stock
        blocks log none)."""
        reading = e2e_interleaved.read(out / "interleaved.json", warmup)
        kappas = [
            kappa for iteration, kappa in self._logged(output)[1].items() if iteration in reading.elastic_iterations
        ]
        return reading, {"elastic": sum(kappas) / len(kappas) if kappas else None}

    def read(self, out: Path, output: str, warmup: int) -> RunReading:
        elapsed, logged_kappas = self._logged(output)
        kappas = list(logged_kappas.values())
        # each logged figure is the mean over the iterations since the previous logged one
        logged = sorted(elapsed)
        spans = [
            (iteration - previous, elapsed[iteration])
            for previous, iteration in itertools.pairwise([0, *logged])
            if previous >= warmup
        ]
        if not spans:
            raise RuntimeError(f"Megatron-LM logged iterations {logged}: none after the warm-up's {warmup}")
        timed_steps = sum(span for span, _ in spans)
        seconds = sum(span * ms for span, ms in spans) / 1e3
        return RunReading(timed_steps / seconds, sum(kappas) / len(kappas) if kappas else None, logged[-1])

    def syncs(self, out: Path) -> int | None:
        return read_syncs(out / "syncs.json")


__all__ = ["MEGATRON_LM_SCRIPT", "MegatronLM", "MegatronSft"]

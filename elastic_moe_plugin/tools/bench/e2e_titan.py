"""The torchtitan row of ``elastic-moe bench --only e2e``: torchtitan's own trainer through the door.

:class:`Torchtitan` runs ``torchtitan.train`` under torchrun (one CPU process, gloo) as a user runs
it, with the door in ``--override.imports 'elastic_moe_plugin.titan.elastic_moe={"schedule": ...}'``
and the CPU runtime switched on in torchrun's worker by the child bootstrap
(:mod:`elastic_moe_plugin.tools.child_bootstrap`, ``titan``), as ``tests/titan/test_titan_trainer.py``
runs it: torchtitan's registered ``deepseek_v3_debugmodel`` (6 layers, H=256, MoE in layers 1-5:
8 routed experts of width 256, top-3, softmax scores, 2 shared experts; selective activation
checkpointing), micro-batch 2 x 64 tokens, float32 parameters, ``--metrics.log_freq 1``;
``schedule: static`` against ``1-5``. The config reads its tokenizer and its ``c4_test`` data from
``./tests/assets`` of the working folder: :meth:`Torchtitan.prepare` writes both there
(:func:`~elastic_moe_plugin.tools.recipes.tiny_assets.write_titan_assets`: a BPE tokenizer of 1024
tokens and 600 documents of random words, as the torchtitan rehearsal; nothing from the hub).

- Interleaved (the default): one run starts elastic and the step probe (:mod:`.step_probe`, target
  ``torchtitan``: ``Trainer.train_step``) switches the door between blocks, to the run's config at
  ``schedule="static"`` (the stock MoE forward, bit for bit) and back (:mod:`.e2e_interleaved`).
- Separate runs (``--separate-runs``): steps/s from torchtitan's step lines, the time from step
  ``warmup``'s line to the last step's over the steps between (what its ``time_metrics/end_to_end(s)``
  adds up: ``MetricsProcessor.log`` to ``MetricsProcessor.log``).
- Mean κ: the door's console line of each logged step (``elastic-moe: step N: mean_kappa ...``,
  ``elastic_moe/mean_kappa`` to the 4 digits it prints); a static step logs every layer at κ = 3.

torchtitan is found as a user's Python finds it: importable here (``importlib.util.find_spec``, no
import), and the child inherits this environment's ``PYTHONPATH``. Otherwise :meth:`Torchtitan.prepare`
raises :class:`~.e2e_child.LauncherUnavailable` and the bench leaves the row out, saying why. Nothing
here imports torchtitan.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from datetime import datetime
from pathlib import Path

from elastic_moe_plugin.tools.bench import e2e_interleaved
from elastic_moe_plugin.tools.bench.e2e_child import (
    Command,
    LauncherUnavailable,
    RunReading,
    child_env,
    probe_env,
)
from elastic_moe_plugin.tools.bench.e2e_swift import read_syncs

SCHEDULES = ("static", "1-5")
DOOR = "elastic_moe_plugin.titan.elastic_moe"
#: torchtitan's command line of every run, before --training.steps, --dump_folder and the door
ARGS = (
    "--module", "deepseek_v3", "--config", "deepseek_v3_debugmodel", "--training.seq_len", "64",
    "--training.local_batch_size", "2", "--training.mixed_precision_param", "float32",
    "--metrics.log_freq", "1", "--debug.seed", "7",
)  # fmt: skip
#: torchtitan's logging prefix (``[titan] 2026-01-01 10:00:00,123 - root - INFO - ``)
_PREFIX = r"\[titan\] (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) - \S+ - INFO - "
_STEP_LINE = re.compile(_PREFIX + r"(?:\x1b\[[\d;]*m)?step:\s*(\d+)\s.*loss:")
_KAPPA_LINE = re.compile(_PREFIX + r"elastic-moe: step (\d+): mean_kappa ([-+.\deE]+|nan)")


def unavailable() -> str | None:
    """Why torchtitan's row cannot run here (None: it can)."""
    if importlib.util.find_spec("torchtitan") is not None:
        return None
    return (
        f"torchtitan is not importable here ({sys.executable}); the door is tested with torchtitan 0.3.0: "
        "pip install torchtitan==0.3.0, or put the folder holding it first on PYTHONPATH (this checkout's "
        "make setup installs it into .torchtitan-0.3.0)"
    )


def logged_steps(output: str) -> tuple[dict[int, float], dict[int, float]]:
    """``({step: its log line's time, s}, {step: the door's logged mean κ})`` of a run's console."""
    times, kappas = {}, {}
    for line in output.splitlines():
        step = _STEP_LINE.search(line)
        if step:
            stamp = datetime.strptime(step.group(1), "%Y-%m-%d %H:%M:%S,%f")
            times[int(step.group(2))] = stamp.timestamp()
            continue
        kappa = _KAPPA_LINE.search(line)
        if kappa:
            kappas[int(kappa.group(2))] = float(kappa.group(3))
    return times, kappas


class Torchtitan:
    """torchtitan's trainer on its DeepSeek-V3 debug model, top-3 of 8 experts: static against elastic 1-5."""

    key, label = "torchtitan", "torchtitan"
    static, elastic = SCHEDULES
    default_steps, default_warmup = 60, 10
    interleaves = True  # static and elastic blocks in one process (e2e_interleaved)
    # every step logs (--metrics.log_freq 1), inside train_step: blocks need not hold whole intervals
    interleave_block, interleave_pairs = 5, 8
    timing = (
        "from torchtitan's step log lines: the time from step warmup's line to the last step's (what its "
        "time_metrics/end_to_end(s) adds up)"
    )

    def __init__(self) -> None:
        self.assets: Path | None = None

    def describe(self) -> str:
        return (
            "DeepSeek-V3 debug model (torchtitan's deepseek_v3_debugmodel), 6 layers, H=256, MoE in 5: 8 experts "
            "of width 256, top-3, 2 shared; micro-batch 2 x 64 tokens, fp32, 1 gloo rank"
        )

    def prepare(self, work: Path, steps: int) -> None:
        """Write the tokenizer and data the debug config reads (torchtitan's working folder).

        Raises:
            LauncherUnavailable: torchtitan is not importable here (:func:`unavailable`).
        """
        reason = unavailable()
        if reason is not None:
            raise LauncherUnavailable(reason)
        from elastic_moe_plugin.tools.recipes.tiny_assets import write_titan_assets

        self.assets = write_titan_assets(work)

    def command(
        self, schedule: str, steps: int, out: Path, sync_step: int, interleave_block: int | None = None
    ) -> Command:
        """One run; with ``interleave_block`` an interleaved one (``schedule`` the elastic one)."""
        from elastic_moe_plugin.tools import child_bootstrap

        if self.assets is None:
            raise RuntimeError("Torchtitan.command before prepare: no assets folder to run in")
        startup = child_bootstrap.environment(("titan", "step_probe"), child_env()["PYTHONPATH"])
        env = child_env(**startup, **probe_env(out, sync_step, "torchtitan", interleave_block))
        argv = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=1",
            "-m",
            "torchtitan.train",
            *ARGS,
            "--training.steps",
            str(steps),
            "--dump_folder",
            str(out / "dump"),
            "--override.imports",
            f"{DOOR}={json.dumps({'schedule': schedule})}",
        ]
        return Command(argv, env, self.assets)

    def read(self, out: Path, output: str, warmup: int) -> RunReading:
        times, kappas = logged_steps(output)
        last = max(times, default=0)
        if warmup not in times or last <= warmup:
            raise RuntimeError(
                f"torchtitan logged steps {sorted(times)}: need step {warmup} (the warm-up's last) and a later one"
            )
        mean = sum(kappas.values()) / len(kappas) if kappas else None
        return RunReading((last - warmup) / (times[last] - times[warmup]), mean, len(times))

    def read_interleaved(
        self, out: Path, output: str, warmup: int
    ) -> tuple[e2e_interleaved.InterleavedReading, dict[str, float | None]]:
        """The interleaved run's timings, and the mean κ each mode's steps logged."""
        reading = e2e_interleaved.read(out / "interleaved.json", warmup)
        _, kappas = logged_steps(output)
        by_mode: dict[str, list[float]] = {mode: [] for mode in e2e_interleaved.MODES}
        for step, kappa in kappas.items():
            by_mode["elastic" if step in reading.elastic_iterations else "static"].append(kappa)
        return reading, {mode: sum(values) / len(values) if values else None for mode, values in by_mode.items()}

    def syncs(self, out: Path) -> int | None:
        return read_syncs(out / "syncs.json")


__all__ = ["ARGS", "SCHEDULES", "Torchtitan", "logged_steps", "unavailable"]

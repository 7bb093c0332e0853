"""``elastic-moe bench --only e2e``: training steps per second of each launcher, static against elastic.

One row per launcher, each run as a user runs it, as a child process of this one, for a fixed
number of steps on a tiny model of the launcher's family (built offline here):

- ``swift_sft``: ``swift sft`` (ms-swift's transformers trainer) on an OLMoE-shaped model, static
  top-8 against elastic ``6-10`` (:mod:`.e2e_swift`);
- ``swift_sft_deepseek_v3``: the same on a tiny DeepSeek-V3 (64 routed experts in 8 groups, top-4
  groups eligible, top-8, × 2.5, one shared expert), static top-8 against elastic ``6-10``
  (:mod:`.e2e_swift`);
- ``megatron_sft``: ``megatron sft`` (Megatron-SWIFT with mcore-bridge, under the CPU runtime's
  start-up bootstrap) on a Qwen3-MoE of 16 experts, top-8, static against ``6-10``
  (:mod:`.e2e_megatron`);
- ``megatron_lm``: Megatron-LM's trainer (``examples/megatron_lm/pretrain_gpt_moe.py`` through
  ``python -m elastic_moe_plugin.megatron_lm --cpu``) on a GPT of 16 experts, top-8, static against
  ``6-10`` (:mod:`.e2e_megatron`);
- ``torchtitan``: torchtitan's trainer (``torchrun -m torchtitan.train``, the door through
  ``--override.imports``, the CPU runtime's child bootstrap) on its DeepSeek-V3 debug model, 8
  experts, top-3, static against ``1-5`` (:mod:`.e2e_titan`). Where torchtitan is not importable
  the row is left out, the table saying why.

Per launcher, ``rounds`` rounds. A round of a Megatron or torchtitan launcher is by default one run
that switches between static and elastic blocks of steps inside the one trainer process (:mod:`.e2e_interleaved`):
the house rule for speed, elastic against stock in one process, interleaved, and the only way to
resolve a few percent on a machine whose speed drifts by far more between runs minutes apart
(docs/performance.md). A round of ``swift sft`` (and, with ``separate=True``, ``--separate-runs``,
of every launcher) is one static and one elastic run, alternating which goes first (static,
elastic; elastic, static; ...) so that load on the machine hits both alike.
Every child runs with one torch thread (``OMP_NUM_THREADS=1``), offline, without a GPU. Per
separate run:

- steps/s, steady state: the steps after ``warmup`` over the time they took, from the launcher's
  own logged timings (ms-swift and Megatron-SWIFT: the cumulative ``train_speed(s/it)`` of
  ``logging.jsonl`` at step ``warmup`` and at the last step; Megatron-LM: the sum of its
  ``elapsed time per iteration (ms)`` over iterations ``warmup + 1`` to the last; torchtitan: the
  time from step ``warmup``'s log line to the last step's);
- peak RSS: ``ru_maxrss`` of ``os.wait4`` on the launcher's process, which Linux reports as the
  largest resident set of that process and of every descendant it waited for (the trainer
  processes of ``swift sft``, of ``megatron sft`` and of torchrun): the largest single process, not
  a sum over ranks. The launcher is started by a bare interpreter (:data:`_RSS_PARENT`) rather than
  by this process, whose own size Linux would otherwise count as the launcher's starting peak;
- host syncs per step: the aten ops that read a device value on the host (``.item()``, ``int(t)``,
  ``.tolist()``, data-dependent shapes: :class:`~.measure.SyncCounter`, which on a CPU-only machine
  counts each read as the device read it would be on a GPU) during training step ``warmup``, the
  last warm-up step, so the counter's own cost stays out of the timed steps; counted by a second
  plugin file for ``swift sft`` (``swift_plugin/bench_callbacks.py``) and by the step probe that wraps
  the trainer's ``train_step`` for the two Megatron launchers and torchtitan (:mod:`.step_probe`), on
  rank 0. The whole step counts: the trainer's own reads (loss logging, gradient clipping, ...)
  as well as the router's and the dispatcher's, static and elastic alike;
- mean κ: the realised experts per token the launcher logged (``elastic_moe/mean_kappa``), averaged
  over the run's logged steps (static: exactly k where the launcher logs it, ms-swift, Megatron-SWIFT
  and torchtitan, whose interleaved static blocks log it too; Megatron-LM's static run and the
  Megatron launchers' interleaved stock blocks log no routing metrics).

The ratio of a round is its elastic steps/s over its static steps/s (an interleaved round: the
median of its block pairs' ratios, :mod:`.e2e_interleaved`); the row gives the median of the rounds'
ratios and their spread (min-max). An interleaved round's two rows share the one process's peak RSS.
``--quick`` (CI) runs one round of a few steps (interleaved: blocks of 2; separate: the two runs of
a launcher side by side; the DeepSeek-V3 row on a 2-layer model of width 64), so its times say
nothing; it shows that every launcher runs and reports every column.

A launcher whose framework is missing here raises :class:`~.e2e_child.LauncherUnavailable` from
``prepare`` (torchtitan: not importable); its row is left out of the table and the schema rows, and
the table says why. The other launchers raise RuntimeError naming what to install.
"""

from __future__ import annotations

import concurrent.futures
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from elastic_moe_plugin.tools.bench import e2e_interleaved
from elastic_moe_plugin.tools.bench.e2e_child import Command, LauncherUnavailable, RunReading
from elastic_moe_plugin.tools.bench.e2e_interleaved import InterleavedReading

#: ``--launchers`` choices, in the order the rows are printed
LAUNCHERS = ("swift_sft", "swift_sft_deepseek_v3", "megatron_sft", "megatron_lm", "torchtitan")
DEFAULT_ROUNDS = 3
QUICK_STEPS, QUICK_WARMUP = 4, 2


@dataclass(frozen=True)
class E2EOptions:
    """What ``--only e2e`` runs: ``steps`` and ``warmup`` per run (None: each launcher's default),
    ``hidden``: the ``swift sft`` rows' hidden size H (and their experts' width, H as well; None: 256),
    ``separate``: the Megatron launchers too in a static and an elastic run per round (their
    default is one interleaved run per round, :mod:`.e2e_interleaved`), ``experts_impl``: the
    ``swift sft`` rows' ``--experts_impl``. The table and the schema rows: :mod:`.e2e_report`."""

    rounds: int = DEFAULT_ROUNDS
    steps: int | None = None
    warmup: int | None = None
    launchers: tuple[str, ...] = LAUNCHERS
    hidden: int | None = None
    work: Path | None = None
    separate: bool = False
    experts_impl: str | None = None  # the swift sft rows' --experts_impl (None: transformers' default)

    def check(self) -> None:
        """Raises ValueError naming the flag, the value, what is accepted and a fix."""
        if self.rounds < 1:
            raise ValueError(f"--rounds {self.rounds}: at least 1 round, e.g. --rounds {DEFAULT_ROUNDS}.")
        unknown = [name for name in self.launchers if name not in LAUNCHERS]
        if unknown:
            raise ValueError(
                f"--launchers {' '.join(unknown)}: expected some of {', '.join(LAUNCHERS)}, "
                f"e.g. --launchers {LAUNCHERS[0]}."
            )
        if self.steps is not None and self.warmup is not None and not 1 <= self.warmup < self.steps:
            raise ValueError(
                f"--steps {self.steps} --warmup {self.warmup}: the warm-up must leave timed steps "
                f"(1 <= warmup < steps), e.g. --steps {self.warmup + 8} --warmup {self.warmup}."
            )
        if self.steps is not None and self.steps < 2:
            raise ValueError(f"--steps {self.steps}: at least 2 (1 warm-up step and 1 timed one), e.g. --steps 20.")
        if self.hidden is not None and (self.hidden < 8 or self.hidden % 4):
            raise ValueError(
                f"--hidden {self.hidden}: a multiple of 4 (the tiny model's 4 heads), at least 8, e.g. --hidden 256."
            )
        if self.work is not None:
            # runs go to WORK/<launcher>/<run>; an earlier bench's would be mixed with these, or stop
            # this one midway (its folders exist): refuse before anything runs
            runs = sorted(
                path
                for launcher in self.launchers
                if (self.work / launcher).is_dir()
                for path in (self.work / launcher).iterdir()
                if path.name != "assets"
            )
            if runs:
                folders = " ".join(str(folder) for folder in sorted({path.parent for path in runs}))
                raise ValueError(
                    f"--work {self.work}: it holds the runs of an earlier bench ({runs[0]}"
                    f"{f' and {len(runs) - 1} more' if len(runs) > 1 else ''}): pass a new or empty "
                    f"folder, e.g. --work {self.work / 'next'}, or remove {folders}."
                )


class Launcher(Protocol):
    """One row of the table. ``prepare`` builds the tiny model and data (for runs of ``steps``) once
    (raises :class:`~.e2e_child.LauncherUnavailable` where the launcher cannot run here); ``command``
    is one run (with ``interleave_block``, where ``interleaves``: one run of both modes); ``read`` /
    ``read_interleaved`` parse its logs (raise RuntimeError when they lack what the row needs);
    ``read_interleaved`` gives the mean κ each mode's steps logged (a mode that logs none: None or left out)."""

    key: str
    label: str
    static: str
    elastic: str
    default_steps: int
    default_warmup: int
    timing: str
    interleaves: bool
    interleave_block: int  # steps per block of an interleaved run (e2e_interleaved)
    interleave_pairs: int  # block pairs after the warm-up in a default interleaved run

    def describe(self) -> str: ...

    def prepare(self, work: Path, steps: int) -> None: ...

    def command(
        self, schedule: str, steps: int, out: Path, sync_step: int, interleave_block: int | None = None
    ) -> Command: ...

    def read(self, out: Path, output: str, warmup: int) -> RunReading: ...

    def read_interleaved(
        self, out: Path, output: str, warmup: int
    ) -> tuple[InterleavedReading, dict[str, float | None]]: ...

    def syncs(self, out: Path) -> int | None: ...


@dataclass
class E2ERun:
    """One schedule of one round. An interleaved round's two runs share a process: its peak RSS
    and wall time, and (on the elastic run) the ratios of its block pairs."""

    schedule: str
    round: int
    steps_per_second: float
    peak_rss_bytes: int
    syncs_per_step: int | None
    mean_kappa: float | None
    wall_s: float
    pair_ratios: list[float] | None = None


@dataclass
class E2EResult:
    """One launcher's row: its runs and what the table derives from them."""

    launcher: str
    label: str
    model: str
    static: str
    elastic: str
    steps: int
    warmup: int
    timing: str
    runs: list[E2ERun] = field(default_factory=list)
    interleave_block: int | None = None  # the blocks' steps when each round is one interleaved run
    unavailable: str | None = None  # why the launcher did not run here (no runs, no summary)

    def of(self, schedule: str) -> list[E2ERun]:
        return sorted((run for run in self.runs if run.schedule == schedule), key=lambda run: run.round)

    def round_ratios(self) -> list[float]:
        """Per round: elastic over static steps/s (an interleaved round: the median of its block pairs')."""
        static = {run.round: run.steps_per_second for run in self.of(self.static)}
        return [
            statistics.median(run.pair_ratios) if run.pair_ratios else run.steps_per_second / static[run.round]
            for run in self.of(self.elastic)
            if run.round in static
        ]

    def summary(self) -> dict:
        ratios = self.round_ratios()

        def column(schedule: str) -> dict:
            runs = self.of(schedule)
            kappas = [run.mean_kappa for run in runs if run.mean_kappa is not None]
            syncs = [run.syncs_per_step for run in runs if run.syncs_per_step is not None]
            return {
                "median_steps_per_second": statistics.median(run.steps_per_second for run in runs),
                "peak_rss_bytes": max(run.peak_rss_bytes for run in runs),
                "syncs_per_step": max(syncs) if syncs else None,
                "mean_kappa": statistics.fmean(kappas) if kappas else None,
            }

        return {
            "static": column(self.static),
            "elastic": column(self.elastic),
            "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "rounds": len(ratios),
        }


# ------------------------------------------------------------------------------------ children
#: the launcher's parent: a bare interpreter (``-I -S``: no site, no sitecustomize) that starts the
#: launcher, waits for it with ``os.wait4`` and writes its ``ru_maxrss`` (KiB) to ``argv[1]``. Linux
#: starts a process's peak RSS at that of the process that forked it (exec records the old address
#: space's high-water mark), so the launcher's own parent must be small: forked from this bench's
#: process (hundreds of MiB of frameworks), the launcher would report at least that.
_RSS_PARENT = (
    "import os, subprocess, sys\n"
    "child = subprocess.Popen(sys.argv[2:])\n"
    "_, status, usage = os.wait4(child.pid, 0)\n"
    "child.returncode = 0\n"
    "open(sys.argv[1], 'w').write(str(usage.ru_maxrss))\n"
    "code = os.waitstatus_to_exitcode(status)\n"
    "sys.exit(code if code >= 0 else 128 - code)\n"
)


def _run_child(command: Command, log: Path) -> tuple[int, int, float]:
    """Run ``command`` with its output in ``log``; (exit status, peak RSS in bytes, seconds)."""
    start = time.perf_counter()
    rss_file = log.with_name("max_rss_kib")
    with log.open("wb") as sink:
        code = subprocess.call(
            [sys.executable, "-I", "-S", "-c", _RSS_PARENT, str(rss_file), *command.argv],
            env=command.env,
            cwd=command.cwd,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    peak = int(rss_file.read_text()) * 1024 if rss_file.exists() else 0  # Linux: ru_maxrss in KiB
    return code, peak, time.perf_counter() - start


def _one_run(launcher: Launcher, schedule: str, round_index: int, steps: int, warmup: int, work: Path) -> E2ERun:
    out = work / launcher.key / f"{schedule}_{round_index}"
    out.mkdir(parents=True)
    command = launcher.command(schedule, steps, out, sync_step=warmup)
    log = out / "output.log"
    code, peak, seconds = _run_child(command, log)
    output = log.read_text(errors="replace")
    if code != 0:
        raise RuntimeError(f"{launcher.label} ({schedule}) exited {code}; its log: {log}\n{output[-3000:]}")
    reading = launcher.read(out, output, warmup)
    return E2ERun(
        schedule=schedule,
        round=round_index,
        steps_per_second=reading.steps_per_second,
        peak_rss_bytes=peak,
        syncs_per_step=launcher.syncs(out),
        mean_kappa=reading.mean_kappa,
        wall_s=seconds,
    )


def _interleaved_runs(
    launcher: Launcher, round_index: int, steps: int, warmup: int, block: int, work: Path
) -> list[E2ERun]:
    """One interleaved round: a single run of the elastic schedule that switches blocks (both rows)."""
    out = work / launcher.key / f"interleaved_{round_index}"
    out.mkdir(parents=True)
    command = launcher.command(launcher.elastic, steps, out, sync_step=warmup, interleave_block=block)
    log = out / "output.log"
    code, peak, seconds = _run_child(command, log)
    output = log.read_text(errors="replace")
    if code != 0:
        raise RuntimeError(f"{launcher.label} (interleaved) exited {code}; its log: {log}\n{output[-3000:]}")
    reading, kappas = launcher.read_interleaved(out, output, warmup)
    mode_schedule = {"static": launcher.static, "elastic": launcher.elastic}
    return [
        E2ERun(
            schedule=mode_schedule[mode],
            round=round_index,
            steps_per_second=reading.steps_per_second[mode],
            peak_rss_bytes=peak,
            syncs_per_step=reading.syncs[mode],
            mean_kappa=kappas.get(mode),
            wall_s=seconds,
            pair_ratios=list(reading.pair_ratios) if mode == "elastic" else None,
        )
        for mode in e2e_interleaved.MODES
    ]


def run_plan(launcher: Launcher, options: E2EOptions, quick: bool) -> tuple[int, int, int | None]:
    """(steps, warm-up, block or None) of the launcher's runs. Raises ValueError naming the flags."""
    if launcher.interleaves and not options.separate:
        block = e2e_interleaved.QUICK_BLOCK if quick else launcher.interleave_block
        warmup = options.warmup or (QUICK_WARMUP if quick else launcher.default_warmup)
        pairs = e2e_interleaved.QUICK_PAIRS if quick else launcher.interleave_pairs
        steps = options.steps or e2e_interleaved.run_steps(warmup, block, pairs)
        least = e2e_interleaved.run_steps(warmup, block, 1)
        if steps < least:
            raise ValueError(
                f"--steps {steps} --warmup {warmup}: {launcher.label} interleaves blocks of {block} "
                f"steps and needs two whole blocks after the warm-up; pass --steps {least} or more "
                f"(or --separate-runs)."
            )
        return steps, warmup, block
    steps = options.steps or (QUICK_STEPS if quick else launcher.default_steps)
    warmup = options.warmup or (QUICK_WARMUP if quick else min(launcher.default_warmup, steps - 1))
    if not 1 <= warmup < steps:
        raise ValueError(
            f"--steps {steps}: {launcher.label} warms up {warmup} steps; pass --warmup "
            f"{max(1, steps // 4)} or more --steps."
        )
    return steps, warmup, None


def launchers(options: E2EOptions, quick: bool = False) -> list[Launcher]:
    """The launchers of ``options``, in :data:`LAUNCHERS`' order (``quick``: the DeepSeek-V3 row on its
    smaller model, :data:`.e2e_swift.DEEPSEEK_V3_QUICK`)."""
    from elastic_moe_plugin.tools.bench import e2e_megatron, e2e_swift, e2e_titan

    make: dict[str, Callable[[], Launcher]] = {
        "swift_sft": lambda: e2e_swift.SwiftSft(hidden=options.hidden, experts_impl=options.experts_impl),
        "swift_sft_deepseek_v3": lambda: e2e_swift.SwiftSft(
            hidden=options.hidden, experts_impl=options.experts_impl, family="deepseek_v3", quick=quick
        ),
        "megatron_sft": e2e_megatron.MegatronSft,
        "megatron_lm": e2e_megatron.MegatronLM,
        "torchtitan": e2e_titan.Torchtitan,
    }
    return [make[key]() for key in LAUNCHERS if key in options.launchers]


def run_e2e(options: E2EOptions, quick: bool, log: Callable[[str], None] | None = None) -> list[E2EResult]:
    """Every launcher of ``options``: ``rounds`` alternating rounds (``quick``: one round of
    :data:`QUICK_STEPS` steps, the two runs side by side)."""
    options.check()
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    rounds = 1 if quick else options.rounds
    work = options.work or Path(tempfile.mkdtemp(prefix="elastic_moe_bench_e2e_"))
    results = []
    chosen = launchers(options, quick)
    plans = [run_plan(launcher, options, quick) for launcher in chosen]  # every launcher's check, first
    for launcher, (steps, warmup, block) in zip(chosen, plans, strict=True):
        started = time.perf_counter()
        timing = e2e_interleaved.TIMING.format(block=block) if block is not None else launcher.timing
        unavailable = None
        try:
            launcher.prepare(work / launcher.key / "assets", steps)
        except LauncherUnavailable as missing:
            log(f"e2e {launcher.label}: not run: {missing}")
            unavailable = str(missing)
        result = E2EResult(
            launcher.key,
            launcher.label,
            launcher.describe(),
            launcher.static,
            launcher.elastic,
            steps,
            warmup,
            timing,
            # an unavailable row ran nothing, so it names no interleaving block
            interleave_block=block if unavailable is None else None,
            unavailable=unavailable,
        )
        results.append(result)
        if unavailable is not None:
            continue
        for round_index in range(rounds):
            order = (launcher.static, launcher.elastic)[:: 1 if round_index % 2 == 0 else -1]
            if block is not None:  # one interleaved run
                runs = _interleaved_runs(launcher, round_index, steps, warmup, block, work)
            elif quick:
                with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
                    futures = [
                        pool.submit(_one_run, launcher, schedule, round_index, steps, warmup, work)
                        for schedule in order
                    ]
                    runs = [future.result() for future in futures]
            else:
                runs = [_one_run(launcher, schedule, round_index, steps, warmup, work) for schedule in order]
            for run in runs:
                result.runs.append(run)
                kappa = f"{run.mean_kappa:.3f}" if run.mean_kappa is not None else "-"
                log(
                    f"e2e {launcher.label} round {round_index} {run.schedule}: {run.steps_per_second:.4f} steps/s, "
                    f"peak RSS {run.peak_rss_bytes / 2**20:.0f} MiB, syncs/step {_or_na(run.syncs_per_step)}, "
                    f"mean κ {kappa}, {run.wall_s:.0f} s"
                )
        log(f"e2e {launcher.label}: {time.perf_counter() - started:.0f} s in all (work folder {work / launcher.key})")
    return results


def _or_na(value) -> str:
    return "n/a" if value is None else str(value)


__all__ = [
    "DEFAULT_ROUNDS",
    "LAUNCHERS",
    "E2EOptions",
    "E2EResult",
    "E2ERun",
    "Launcher",
    "launchers",
    "run_e2e",
    "run_plan",
]

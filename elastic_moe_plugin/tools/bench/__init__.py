"""``elastic-moe bench``: every measurement of the package, one mode each (``--only``), one JSON
format (:mod:`.schema`) for all of them (``docs/performance.md``).

Elastic against stock, in one process, interleaved:

- ``router``, ``routing``, ``layer``, ``gpt`` (:mod:`.megatron`): Megatron-core's router, its
  routing alone, a MoE layer (dropless and drop-and-pad), a GPT training step;
- ``hf`` (:mod:`.hf`): transformers' OLMoE-, Qwen3-MoE- and DeepSeek-V3-shaped sparse MoE blocks
  and Gemma 4's MoE branch (its decoder layer's router and experts) per experts implementation,
  with the rows the expert GEMMs multiply;
- ``kappa`` (:mod:`.kappa`): the κ draw of one router call, as the routers make it, as the number
  of token shards grows, against the draw before the counter-based stream;
- ``calls`` (:mod:`.calls`): one router call per door, µs and the package's calls in it;
- ``mcore-cuda`` (:mod:`.mcore_cuda`): the Megatron adapter on a CUDA GPU, its dispatchers checked
  against a dense reference, its host syncs counted, a Qwen3-sized layer timed;
- ``log-metrics`` (:mod:`.log_metrics`): a logging step of the transformers door's routing metrics,
  ``log_metrics: layers`` against ``means``.

In child processes:

- ``e2e`` (:mod:`.e2e`): training end to end, one row per launcher (``swift sft`` on OLMoE and
  on DeepSeek-V3, ``megatron sft``, Megatron-LM's trainer, torchtitan's trainer), static against elastic;
- ``swift-profile`` (:mod:`.swift_profile`): ``swift sft`` under torch.profiler, op by op;
- ``hook-cost`` (:mod:`.hook_cost`): what the ms-swift start-up hook costs a process.

:data:`MODES` names and describes them (``elastic-moe bench --help`` lists them); without ``--only``
the :data:`DEFAULT_MODES` run. :func:`run_suite` runs the modes asked for, each giving a
:class:`Section` (its text table and its schema rows); :func:`format_results` prints the tables,
:func:`to_json` is ``--json``. This module imports no framework (each mode's module does, when run).
"""

from __future__ import annotations

import importlib.metadata
import platform
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from elastic_moe_plugin.tools.bench.schema import BenchReport, BenchRow, Scalar, report

if TYPE_CHECKING:
    from elastic_moe_plugin.tools.bench.e2e import E2EOptions

#: every mode (``--only``), with what it measures
MODES: dict[str, str] = {
    "router": "Megatron-core's TopKRouter alone, forward+backward, aux loss on: stock, elastic iid, elastic balanced",
    "routing": "router.routing(logits) alone, from leaf logits (no gating GEMM): the part elastic routing changes",
    "layer": "a Megatron-core MoE layer: allgather, alltoall, and alltoall with drop-and-pad",
    "gpt": "a training step of a tiny Megatron-core GPT with MoE in every layer",
    "hf": "transformers' OLMoE, Qwen3-MoE and DeepSeek-V3 sparse MoE blocks and Gemma 4's MoE branch (the "
    "router and experts of its decoder layer) under every experts implementation",
    "kappa": "the κ draw of one router call, through each door's stream as the routers draw, for 1-1024 token "
    "shards, against the draw before the counter-based stream",
    "calls": "one router call per door, stock, static and elastic: µs per call and the package's calls in it",
    "mcore-cuda": "the Megatron adapter on a CUDA GPU: dispatchers against a dense reference, host syncs per "
    "layer, a Qwen3-sized layer timed (without CUDA: tiny shapes on the CPU runtime)",
    "log-metrics": "a logging step of the transformers door's routing metrics through TensorBoard's writer, "
    "log_metrics layers against means, at 48 MoE layers (--quick: 8)",
    "e2e": "training steps/s of swift sft (OLMoE, DeepSeek-V3), megatron sft, Megatron-LM's trainer and "
    "torchtitan's trainer (where importable) on tiny models, static against elastic (6-10; torchtitan: 1-5), "
    "in child processes (minutes)",
    "swift-profile": "swift sft under torch.profiler, static against 6-10: the ops whose self CPU time "
    "differs most (two child runs)",
    "hook-cost": "what the ms-swift start-up hook (elastic-moe-swift.pth) costs a process: the wheel "
    "against no plugin in two fresh venvs (builds the wheel of this checkout)",
}
#: what runs without ``--only``: the in-process comparisons of elastic against stock
DEFAULT_MODES = ("router", "layer", "gpt", "hf", "kappa", "calls")
MEGATRON_MODES = ("router", "routing", "layer", "gpt")


@dataclass(frozen=True)
class BenchOptions:
    """What the modes take besides ``quick`` and ``threads``: ``aux`` (Megatron's routers with the
    aux loss), ``rounds`` (``mcore-cuda``'s timing rounds, ``log-metrics``' rounds, ``hook-cost``'s
    runs; None: each mode's default), ``profile`` (``swift-profile``'s ``FIRST:COUNT``), ``e2e``
    (``e2e``'s options, whose ``steps``, ``hidden``, ``experts_impl`` and ``work`` ``swift-profile``
    shares)."""

    aux: bool = True
    rounds: int | None = None
    profile: str | None = None
    e2e: E2EOptions | None = None


@dataclass
class Section:
    """What one or more modes measured: their text table, their schema rows and their own results."""

    modes: tuple[str, ...]
    table: str
    rows: list[BenchRow]
    results: list[Any] = field(default_factory=list)


def _megatron(quick: bool, threads: int, modes: list[str], options: BenchOptions) -> Section:
    from elastic_moe_plugin.tools.bench import megatron

    aux_coeff = megatron.AUX_COEFF if options.aux else 0.0
    results = megatron.run_suite(quick, threads, modes, aux_coeff)
    return Section(tuple(modes), scenario_table(results), [r for result in results for r in result.rows()], results)


def _hf(quick: bool, threads: int, options: BenchOptions) -> Section:
    from elastic_moe_plugin.tools.bench import hf

    results = hf.run_suite(quick, threads)
    return Section(("hf",), scenario_table(results), [r for result in results for r in result.rows()], results)


def _kappa(quick: bool, threads: int, options: BenchOptions) -> Section:
    from elastic_moe_plugin.tools.bench import kappa

    results = kappa.run_suite(quick, threads)
    return Section(("kappa",), kappa.format_table(results), kappa.rows(results), results)


def _calls(quick: bool, threads: int, options: BenchOptions) -> Section:
    from elastic_moe_plugin.tools.bench import calls

    results = calls.run_suite(quick, threads)
    return Section(("calls",), calls.format_table(results), calls.rows(results), results)


def _mcore_cuda(quick: bool, threads: int, options: BenchOptions) -> Section:
    from elastic_moe_plugin.tools.bench import mcore_cuda

    rows = mcore_cuda.run_suite(quick, threads, options.rounds)
    return Section(("mcore-cuda",), mcore_cuda.format_table(rows), rows)


def _log_metrics(quick: bool, threads: int, options: BenchOptions) -> Section:
    from elastic_moe_plugin.tools.bench import log_metrics

    result = log_metrics.run(quick, threads, options.rounds)
    return Section(("log-metrics",), log_metrics.format_table(result), log_metrics.rows(result), [result])


def _e2e_options(options: BenchOptions) -> E2EOptions:
    from elastic_moe_plugin.tools.bench.e2e import E2EOptions

    return options.e2e or E2EOptions()


def _e2e(quick: bool, threads: int, options: BenchOptions) -> Section:
    from elastic_moe_plugin.tools.bench import e2e, e2e_report

    results = e2e.run_e2e(_e2e_options(options), quick)
    return Section(("e2e",), e2e_report.format_table(results), e2e_report.rows(results), results)


def _swift_profile(quick: bool, threads: int, options: BenchOptions) -> Section:
    from elastic_moe_plugin.tools.bench import swift_profile

    e2e = _e2e_options(options)
    work = e2e.work / "swift_profile" if e2e.work is not None else None
    result = swift_profile.run(quick, e2e.steps, options.profile, e2e.hidden, e2e.experts_impl, work)
    return Section(("swift-profile",), swift_profile.format_table(result), swift_profile.rows(result), [result])


def _hook_cost(quick: bool, threads: int, options: BenchOptions) -> Section:
    from elastic_moe_plugin.tools.bench import hook_cost

    times = hook_cost.run(quick, options.rounds)
    return Section(("hook-cost",), hook_cost.format_table(times), hook_cost.rows(times), [times])


_RUNNERS: dict[str, Callable[[bool, int, BenchOptions], Section]] = {
    "hf": _hf,
    "kappa": _kappa,
    "calls": _calls,
    "mcore-cuda": _mcore_cuda,
    "log-metrics": _log_metrics,
    "e2e": _e2e,
    "swift-profile": _swift_profile,
    "hook-cost": _hook_cost,
}


def check_options(only: list[str] | None, options: BenchOptions, quick: bool = False) -> None:
    """Raise ValueError (naming the flag, the value and a fix) before anything runs."""
    wanted = list(only or DEFAULT_MODES)
    unknown = [mode for mode in wanted if mode not in MODES]
    if unknown:
        raise ValueError(f"--only {' '.join(unknown)}: expected some of {', '.join(MODES)}, e.g. --only router.")
    if options.rounds is not None and options.rounds < 1:
        raise ValueError(f"--rounds {options.rounds}: at least 1 round, e.g. --rounds 3.")
    if "e2e" in wanted or "swift-profile" in wanted:
        _e2e_options(options).check()
    if "swift-profile" in wanted:
        from elastic_moe_plugin.tools.bench import swift_profile

        e2e = _e2e_options(options)
        swift_profile.check(quick, e2e.steps, options.profile, e2e.work)


def run_suite(
    quick: bool, threads: int, only: list[str] | None = None, options: BenchOptions | None = None
) -> list[Section]:
    """The modes named in ``only`` (:data:`DEFAULT_MODES` when None), in :data:`MODES`' order, the
    Megatron ones in one section; bad options fail before anything runs."""
    options = options or BenchOptions()
    check_options(only, options, quick)
    wanted = [mode for mode in MODES if mode in (only or DEFAULT_MODES)]
    sections = []
    megatron_modes = [mode for mode in MEGATRON_MODES if mode in wanted]
    if megatron_modes:
        sections.append(_megatron(quick, threads, megatron_modes, options))
    for mode in wanted:
        if mode not in MEGATRON_MODES:
            sections.append(_RUNNERS[mode](quick, threads, options))
    return sections


def scenario_table(results: list[Any]) -> str:
    """The table of :class:`~.measure.ScenarioResult` objects (Megatron's, or the transformers
    blocks', whose realised pairs are the rows the expert GEMMs multiplied)."""
    if not results:
        return ""
    blocks = hasattr(results[0], "implementation")
    width = 22 if blocks else 16
    lines = [_header("block / experts" if blocks else "scenario", width, dispatched=blocks)]
    for result in results:
        if blocks:
            lines.append(f"-- {result.scenario}, experts_implementation={result.implementation}: {result.shape}")
            label = f"{result.scenario.removesuffix('-block')} {result.implementation}"
        else:
            lines.append(f"-- {result.scenario}: {result.shape}")
            label = result.scenario
        lines += _rows(result, label, width)
    if blocks:
        lines.append(
            "pairs exp/real: T·k / rows the expert GEMMs multiplied in one forward; Σκ: what the router "
            "dispatched in that forward (stock: T·k)"
        )
    return "\n".join(lines)


def _rows(result: Any, label: str, width: int) -> list[str]:
    lines = []
    ratios = result.ratios()
    for name, variant in result.variants.items():
        ratio = ratios.get(name, {"time_ratio": 1.0, "memory_ratio": 1.0, "syncs_added": 0})
        line = (
            f"{label:{width}s} {name:9s} {variant.median_ms:10.2f} "
            f"{variant.min_ms:8.2f}-{variant.max_ms:8.2f} {ratio['time_ratio']:7.3f} "
            f"{variant.peak_bytes / 2**20:9.1f} {ratio['memory_ratio']:6.3f} {variant.syncs_per_forward:5d} "
            f"{ratio['syncs_added']:+6d} {variant.expected_pairs:>7d}/{variant.realised_pairs:<8d}"
        )
        if hasattr(variant, "dispatched_pairs"):
            line += f" {variant.dispatched_pairs:>7d}"
        lines.append(line)
    return lines


def _header(first: str, width: int, *, dispatched: bool = False) -> str:
    return (
        f"{first:{width}s} {'variant':9s} {'median ms':>10s} {'min-max ms':>17s} {'time x':>7s} "
        f"{'peak MiB':>9s} {'mem x':>6s} {'syncs':>5s} {'+syncs':>6s} {'pairs exp/real':>16s}"
        + (f" {'Σκ':>7s}" if dispatched else "")
    )


def format_results(sections: list[Section]) -> str:
    """Every section's table, a blank line between them."""
    return "\n\n".join(section.table for section in sections if section.table)


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(threads: int) -> dict[str, Scalar]:
    """Where the bench ran: versions, device, torch threads."""
    import torch

    values: dict[str, Scalar] = {"python": platform.python_version(), "torch": torch.__version__}
    for name in (
        "numpy",
        "megatron-core",
        "transformers",
        "ms-swift",
        "mcore-bridge",
        "torchtitan",
        "elastic-moe-plugin",
    ):
        values[name.replace("-", "_")] = _version(name)
    values.update(
        device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        threads=torch.get_num_threads(),
        threads_asked=threads,
        machine=platform.machine(),
    )
    return values


def to_json(sections: list[Section], quick: bool, threads: int) -> BenchReport:
    """The ``--json`` report (:mod:`.schema`) of ``sections``."""
    modes = [mode for section in sections for mode in section.modes]
    return report(quick, modes, environment(threads), [r for section in sections for r in section.rows])


__all__ = [
    "DEFAULT_MODES",
    "MEGATRON_MODES",
    "MODES",
    "BenchOptions",
    "Section",
    "check_options",
    "environment",
    "format_results",
    "run_suite",
    "scenario_table",
    "to_json",
]

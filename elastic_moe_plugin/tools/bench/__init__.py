"""``elastic-moe bench``: elastic against stock, in one process, interleaved (``docs/performance.md``).

- :mod:`.measure`: the measuring core (interleaved median-of-rounds timing, peak live bytes,
  host syncs, pairs) that every scenario goes through;
- :mod:`.megatron`: Megatron-core scenarios (``router``, ``layer`` with its drop-and-pad case, ``gpt``);
- :mod:`.hf`: transformers scenarios (``hf``): an OLMoE-, a Qwen3-MoE- and a DeepSeek-V3-shaped
  sparse MoE block per experts implementation, with the rows the expert GEMMs multiply;
- :mod:`.kappa`: the κ draw itself (``kappa``), time and memory per router call as the number of
  token shards grows, the draw before the counter-based stream against the one now;
- :mod:`.calls`: one router call (``calls``), stock against patched, per door: µs per call and
  the package's calls and modules in one elastic call;
- :mod:`.e2e`: training end to end (``e2e``), one row per launcher (``swift sft`` on OLMoE and on
  DeepSeek-V3, ``megatron sft``, Megatron-LM's trainer), each a child process per run, static
  against elastic in alternating rounds (:mod:`.e2e_swift`, :mod:`.e2e_megatron`). It runs only when ``only`` names it.

:func:`run_suite` runs what ``only`` names; :func:`format_results` prints the Megatron table (its
format unchanged), then the transformers table, the κ draw's and the end-to-end table;
:func:`to_json` is ``--json``.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, TypeAlias, TypeGuard

import torch

from elastic_moe_plugin.tools.bench.measure import (
    SYNC_OPS,
    VARIANTS,
    LiveBytes,
    ScenarioResult,
    Step,
    SyncCounter,
    VariantResult,
    measure,
)

if TYPE_CHECKING:
    from elastic_moe_plugin.tools.bench.calls import RouterCallResult
    from elastic_moe_plugin.tools.bench.e2e import E2EOptions, E2EResult
    from elastic_moe_plugin.tools.bench.hf import ExpertsScenarioResult, ExpertsVariantResult
    from elastic_moe_plugin.tools.bench.kappa import KappaDrawResult

    #: a row of any scenario: Megatron's and the transformers blocks' are ScenarioResults
    BenchResult: TypeAlias = ScenarioResult | KappaDrawResult | RouterCallResult | E2EResult

#: ``--only`` choices: the Megatron scenarios, ``hf`` for the transformers blocks, ``kappa`` for the κ
#: draw, ``calls`` for one router call per door, ``e2e`` for the launchers end to end
SCENARIOS = ("router", "layer", "gpt", "hf", "kappa", "calls", "e2e")
#: what runs without ``--only``: every in-process scenario (``e2e`` trains with each launcher: minutes)
DEFAULT_SCENARIOS = ("router", "layer", "gpt", "hf", "kappa", "calls")
MEGATRON_SCENARIOS = ("router", "layer", "gpt")


def run_suite(
    quick: bool, threads: int, only: list[str] | None = None, e2e_options: E2EOptions | None = None
) -> list[BenchResult]:
    """The scenarios named in ``only`` (:data:`DEFAULT_SCENARIOS` when None), Megatron first, then
    transformers, the κ draw and the launchers end to end (with ``e2e_options``, an
    :class:`~.e2e.E2EOptions`; its defaults when None)."""
    wanted = list(only or DEFAULT_SCENARIOS)
    if "e2e" in wanted:  # bad options fail before anything runs
        from elastic_moe_plugin.tools.bench import e2e

        e2e_options = e2e_options or e2e.E2EOptions()
        e2e_options.check()
    results: list[BenchResult] = []
    megatron_wanted = [name for name in MEGATRON_SCENARIOS if name in wanted]
    if megatron_wanted:
        from elastic_moe_plugin.tools.bench import megatron

        results += megatron.run_suite(quick, threads, megatron_wanted)
    if "hf" in wanted:
        from elastic_moe_plugin.tools.bench import hf

        results += hf.run_suite(quick, threads)
    if "kappa" in wanted:
        from elastic_moe_plugin.tools.bench import kappa

        results += kappa.run_suite(quick, threads)
    if "calls" in wanted:
        from elastic_moe_plugin.tools.bench import calls

        results += calls.run_suite(quick, threads)
    if e2e_options is not None and "e2e" in wanted:  # set above whenever e2e is wanted
        results += e2e.run_e2e(e2e_options, quick)
    return results


def _is_kappa(result: BenchResult) -> TypeGuard[KappaDrawResult]:
    return hasattr(result, "num_shards")


def _is_e2e(result: BenchResult) -> TypeGuard[E2EResult]:
    return hasattr(result, "launcher")


def _is_call(result: BenchResult) -> TypeGuard[RouterCallResult]:
    return hasattr(result, "door")


def _is_scenario(result: BenchResult) -> TypeGuard[ScenarioResult]:
    return not _is_kappa(result) and not _is_e2e(result) and not _is_call(result)


def _is_block(result: ScenarioResult) -> TypeGuard[ExpertsScenarioResult]:
    return hasattr(result, "implementation")


def _is_block_variant(variant: VariantResult) -> TypeGuard[ExpertsVariantResult]:
    return hasattr(variant, "dispatched_pairs")


def _rows(result: ScenarioResult, label: str, width: int) -> list[str]:
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
        if _is_block_variant(variant):
            line += f" {variant.dispatched_pairs:>7d}"
        lines.append(line)
    return lines


def _header(first: str, width: int, *, dispatched: bool = False) -> str:
    return (
        f"{first:{width}s} {'variant':9s} {'median ms':>10s} {'min-max ms':>17s} {'time x':>7s} "
        f"{'peak MiB':>9s} {'mem x':>6s} {'syncs':>5s} {'+syncs':>6s} {'pairs exp/real':>16s}"
        + (f" {'Σκ':>7s}" if dispatched else "")
    )


def format_results(results: list[BenchResult]) -> str:
    """The Megatron table, then (if any) the transformers table: realised pairs there are the rows
    the expert GEMMs multiplied."""
    draws = [result for result in results if _is_kappa(result)]
    launchers = [result for result in results if _is_e2e(result)]
    scenarios = [result for result in results if _is_scenario(result)]
    megatron = [result for result in scenarios if not _is_block(result)]
    blocks = [result for result in scenarios if _is_block(result)]
    lines: list[str] = []
    if megatron:
        lines.append(_header("scenario", 16))
        for result in megatron:
            lines.append(f"-- {result.scenario}: {result.shape}")
            lines += _rows(result, result.scenario, 16)
    if blocks:
        if lines:
            lines.append("")
        lines.append(_header("block / experts", 22, dispatched=True))
        for result in blocks:
            lines.append(f"-- {result.scenario}, experts_implementation={result.implementation}: {result.shape}")
            lines += _rows(result, f"{result.scenario.removesuffix('-block')} {result.implementation}", 22)
        lines.append(
            "pairs exp/real: T·k / rows the expert GEMMs multiplied in one forward; Σκ: what the router "
            "dispatched in that forward (stock: T·k)"
        )
    if draws:
        from elastic_moe_plugin.tools.bench import kappa

        if lines:
            lines.append("")
        lines.append(kappa.format_table(draws))
    router_calls = [result for result in results if _is_call(result)]
    if router_calls:
        from elastic_moe_plugin.tools.bench import calls

        if lines:
            lines.append("")
        lines.append(calls.format_table(router_calls))
    if launchers:
        from elastic_moe_plugin.tools.bench import e2e

        if lines:
            lines.append("")
        lines.append(e2e.format_table(launchers))
    return "\n".join(lines)


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def to_json(results: list[BenchResult]) -> dict[str, Any]:
    draws = [asdict(result) for result in results if _is_kappa(result)]
    launchers = [result for result in results if _is_e2e(result)]
    scenarios = [result for result in results if _is_scenario(result)]
    report: dict[str, Any] = {"torch": torch.__version__}
    if any(not _is_block(result) for result in scenarios):
        report["megatron_core"] = importlib.metadata.version("megatron-core")
    if any(_is_block(result) for result in scenarios):
        report["transformers"] = _version("transformers")
    report.update(
        {
            "device": "cuda" if torch.cuda.is_available() else "cpu",
            "threads": torch.get_num_threads(),
            "scenarios": [
                {
                    "scenario": r.scenario,
                    **({"implementation": r.implementation} if _is_block(r) else {}),
                    "shape": r.shape,
                    "variants": {n: asdict(v) for n, v in r.variants.items()},
                    "ratios": r.ratios(),
                }
                for r in scenarios
            ],
        }
    )
    if draws:
        report["kappa_draw"] = draws
    router_calls = [asdict(result) for result in results if _is_call(result)]
    if router_calls:
        report["router_calls"] = router_calls
    if launchers:
        from elastic_moe_plugin.tools.bench import e2e

        report.update(
            e2e_versions={
                name: _version(name) for name in ("ms-swift", "megatron-core", "transformers", "mcore-bridge")
            },
            e2e=e2e.to_json(launchers),
        )
    return report


__all__ = [
    "DEFAULT_SCENARIOS",
    "MEGATRON_SCENARIOS",
    "SCENARIOS",
    "SYNC_OPS",
    "VARIANTS",
    "LiveBytes",
    "ScenarioResult",
    "Step",
    "SyncCounter",
    "VariantResult",
    "format_results",
    "measure",
    "run_suite",
    "to_json",
]

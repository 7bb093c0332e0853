"""End to end: ``swift sft`` steps/s on a tiny local OLMoE, static top-8 against elastic 6-10.

    python scripts/swift_sft_speed.py [--steps 20] [--warmup 4] [--rounds 2] [--work DIR] [--experts-impl IMPL]
                                      [--hidden 256] [--ffn 256] [--layers 4] [--profile FIRST:COUNT]

A thin wrapper of the ``swift sft`` row of ``elastic-moe bench --only e2e``
(``elastic_moe_plugin/tools/bench/e2e_swift.py``, which builds the model and runs ``swift sft``):
a tiny OLMoE-shaped model (4 layers, hidden 256, 64 experts of width 256, top-8,
``norm_topk_prob=False``; ``--hidden``, ``--ffn`` and ``--layers`` change the size), real ``swift sft``
(full fine-tuning, the plugin file and ``--callbacks elastic_moe``, one torch thread, CPU) for a fixed
number of steps with ``ELASTIC_MOE_SCHEDULE=static`` and ``=6-10``, alternating the two ``--rounds``
times so load on the machine hits both alike. The experts implementation is transformers' default
(``grouped_mm``) unless ``--experts-impl`` names one.

Steps/s per run are steady-state: from swift's logged cumulative ``train_speed(s/it)`` at step
``--warmup`` and at the last step, (last - warmup) / (time at last - time at warmup). Prints one
line per run, the medians, their ratio, and a JSON line. The bench's row adds peak memory and host
syncs (``elastic-moe bench --only e2e --launchers swift_sft``).

``--profile FIRST:COUNT`` instead runs each schedule once under torch.profiler (steps FIRST + 1 to
FIRST + COUNT, host activities; the bench's second plugin file,
``elastic_moe_plugin/tools/bench/swift_plugin/bench_callbacks.py``) and prints the ops whose self
CPU time differs most between 6-10 and static, summed over those steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from elastic_moe_plugin.tools.bench import e2e_swift


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=4, help="steps left out of the steady-state rate")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--experts-impl", default=None, help="swift's --experts_impl (default: transformers' own)")
    parser.add_argument("--hidden", type=int, default=e2e_swift.MODEL["hidden_size"], help="hidden size H")
    parser.add_argument("--ffn", type=int, default=e2e_swift.MODEL["intermediate_size"], help="expert FFN width F")
    parser.add_argument("--layers", type=int, default=e2e_swift.MODEL["num_hidden_layers"])
    parser.add_argument("--profile", default=None, metavar="FIRST:COUNT",
                        help="profile steps FIRST+1..FIRST+COUNT of one run per schedule instead of timing rounds")
    args = parser.parse_args(argv)
    model = {**e2e_swift.MODEL, "hidden_size": args.hidden, "intermediate_size": args.ffn,
             "num_hidden_layers": args.layers}
    work = args.work or Path(tempfile.mkdtemp(prefix="elastic_moe_swift_speed_"))
    model_dir, dataset = e2e_swift.build(work, model)
    if args.profile is not None:
        print(json.dumps(e2e_swift.profile_differences(model_dir, dataset, work, args.steps, args.experts_impl,
                                                       args.profile)))
        return 0
    rates: dict[str, list[float]] = {schedule: [] for schedule in e2e_swift.SCHEDULES}
    kappa: dict[str, list[float]] = {schedule: [] for schedule in e2e_swift.SCHEDULES}
    for round_index in range(args.rounds):
        order = e2e_swift.SCHEDULES if round_index % 2 == 0 else e2e_swift.SCHEDULES[::-1]
        for schedule in order:
            out = work / f"{schedule}_{round_index}"
            out.mkdir(parents=True)
            e2e_swift.run_once(e2e_swift.command(model_dir, dataset, schedule, args.steps, out, args.experts_impl),
                               out / "output.log")
            rows = e2e_swift.logged_rows(out)
            rate = e2e_swift.steady_steps_per_second(rows, args.warmup)
            rates[schedule].append(rate)
            mean = e2e_swift.logged_mean_kappa(rows)
            if mean is not None:
                kappa[schedule].append(mean)
            logged = f"{mean:.3f}" if mean is not None else "- (static: not logged)"
            print(f"round {round_index} {schedule:7s} {rate:.4f} steps/s  mean κ {logged}", flush=True)
    medians = {schedule: statistics.median(values) for schedule, values in rates.items()}
    print(f"median steps/s: static {medians['static']:.4f}, 6-10 {medians['6-10']:.4f}, "
          f"6-10/static = {medians['6-10'] / medians['static']:.3f}")
    print(json.dumps({"steps": args.steps, "warmup": args.warmup, "rounds": args.rounds, "model": model,
                      "experts_impl": args.experts_impl or "default", "steps_per_second": rates,
                      "median": medians, "ratio": medians["6-10"] / medians["static"],
                      "mean_kappa": {s: statistics.fmean(v) if v else None for s, v in kappa.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

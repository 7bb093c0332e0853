"""End to end: ``swift sft`` steps/s on a tiny local OLMoE, static top-8 against elastic 6-10.

    python scripts/swift_sft_speed.py [--steps 20] [--rounds 2] [--work DIR] [--experts-impl IMPL]
                                      [--hidden 256] [--ffn 256] [--layers 4] [--profile FIRST:COUNT]

Builds, offline, a tiny OLMoE-shaped model (4 layers, hidden 256, 64 experts of width 256, top-8,
``norm_topk_prob=False``; ``--hidden``, ``--ffn`` and ``--layers`` change the size; the tokenizer
and the chat dataset of ``tests/swift/_tiny_assets.py``),
then runs real ``swift sft`` (full fine-tuning, the documented ``--external_plugins`` and
``--callbacks elastic_moe``, one torch thread, CPU) for a fixed number of steps with
``ELASTIC_MOE_SCHEDULE=static`` and ``=6-10``, alternating the two ``--rounds`` times so load on the
machine hits both alike. The experts implementation is transformers' default (``grouped_mm``)
unless ``--experts-impl`` names one.

Steps/s per run are steady-state: from swift's logged cumulative ``train_speed(s/it)`` at step
``--warmup`` and at the last step, (last - warmup) / (time at last - time at warmup). Prints one
line per run, the medians, their ratio, and a JSON line.

``--profile FIRST:COUNT`` instead runs each schedule once under torch.profiler (steps FIRST + 1 to
FIRST + COUNT, host activities; ``scripts/swift_sft_profile_plugin.py``, a second plugin file) and
prints the ops whose self CPU time differs most between 6-10 and static, summed over those steps.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = {  # OLMoE-shaped routing (64 experts, top-8, full-softmax gate), tiny width and depth
    "num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 256, "num_attention_heads": 4,
    "num_key_value_heads": 4, "num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": False,
}
SCHEDULES = ("static", "6-10")


@functools.lru_cache(maxsize=1)
def _tiny_assets():
    """tests/swift/_tiny_assets.py, loaded by path (it is no package module)."""
    path = ROOT / "tests" / "swift" / "_tiny_assets.py"
    spec = importlib.util.spec_from_file_location("_elastic_moe_tiny_assets", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def build(work: Path, model: dict) -> tuple[Path, Path]:
    """The OLMoE-shaped model directory and the dataset, under ``work``."""
    import torch
    from transformers import AutoTokenizer
    from transformers.models.olmoe import OlmoeConfig, OlmoeForCausalLM

    assets = _tiny_assets().build(work / "assets")
    tokenizer = AutoTokenizer.from_pretrained(assets.model_dir("olmoe"))
    config = OlmoeConfig(**{**_tiny_assets().COMMON_CONFIG, **model}, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    model_dir = work / "olmoe_e64_k8"
    with torch.random.fork_rng():
        torch.manual_seed(0)
        OlmoeForCausalLM(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return model_dir, assets.dataset


PROFILE_PLUGIN = ROOT / "scripts" / "swift_sft_profile_plugin.py"


def run(model_dir: Path, dataset: Path, schedule: str, steps: int, out: Path, experts_impl: str | None,
        profile: str | None = None) -> list[dict]:
    """One ``swift sft`` run; its logged training rows. With ``profile`` ("first:count"), the
    profiler's table lands in ``out / "profile.json"``."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("ELASTIC_MOE_")}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", CUDA_VISIBLE_DEVICES="",
               OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", TORCH_COMPILE_DISABLE="1",
               HF_DATASETS_CACHE=str(out / "hf_datasets"), MODELSCOPE_CACHE=str(out / "modelscope"),
               ELASTIC_MOE_SCHEDULE=schedule)
    swift = Path(sys.executable).with_name("swift")
    command = [
        str(swift), "sft", "--model", str(model_dir), "--model_type", "olmoe", "--template", "olmoe",
        "--dataset", str(dataset), "--check_model", "false",
        "--external_plugins", "patches/elastic_moe.py", "--callbacks", "elastic_moe",
        "--tuner_type", "full", "--max_steps", str(steps), "--logging_steps", "1", "--router_aux_loss_coef", "0.01",
        "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "1", "--max_length", "512",
        "--save_strategy", "no", "--report_to", "none", "--dataloader_num_workers", "0", "--dataset_num_proc", "1",
        "--output_dir", str(out / "run"), "--add_version", "false",
    ]
    if experts_impl is not None:
        command += ["--experts_impl", experts_impl]
    if profile is not None:
        plugins = command.index("--callbacks")
        command[plugins - 1:plugins + 2] = ["patches/elastic_moe.py", str(PROFILE_PLUGIN), "--callbacks", "elastic_moe",
                                            "sft_profile"]
        env.update(SWIFT_SFT_PROFILE_STEPS=profile, SWIFT_SFT_PROFILE_OUT=str(out / "profile.json"))
    log = out / "output.log"
    with log.open("wb") as sink:
        code = subprocess.call(command, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT)
    if code != 0:
        raise RuntimeError(f"swift sft ({schedule}) exited {code}; see {log}")
    rows = [json.loads(line) for line in (out / "run" / "logging.jsonl").read_text().splitlines() if line.strip()]
    return rows


def steady_steps_per_second(rows: list[dict], warmup: int) -> float:
    """(last - warmup) steps over the time between them, from swift's cumulative s/it."""
    speeds = {int(row["global_step/max_steps"].split("/")[0]): row["train_speed(s/it)"]
              for row in rows if "train_speed(s/it)" in row and "loss" in row}
    last = max(speeds)
    return (last - warmup) / (speeds[last] * last - speeds[warmup] * warmup)


def profile_differences(model_dir: Path, dataset: Path, work: Path, steps: int, experts_impl: str | None,
                        profile: str, top: int = 15) -> dict:
    """One profiled run per schedule; prints and returns the largest self-CPU differences by op."""
    tables = {}
    for schedule in SCHEDULES:
        out = work / f"profile_{schedule}"
        out.mkdir(parents=True)
        run(model_dir, dataset, schedule, steps, out, experts_impl, profile=profile)
        tables[schedule] = json.loads((out / "profile.json").read_text())
    static, elastic = tables["static"], tables["6-10"]
    totals = {schedule: sum(us for us, _ in table.values()) / 1e3 for schedule, table in tables.items()}
    rows = sorted(((elastic.get(op, [0, 0])[0] - static.get(op, [0, 0])[0]) / 1e3, op) for op in set(static) | set(elastic))
    print(f"self CPU over steps {profile}: static {totals['static']:.0f} ms, 6-10 {totals['6-10']:.0f} ms "
          f"({totals['6-10'] - totals['static']:+.0f} ms)")
    print(f"{'op':42s} {'static ms':>10s} {'6-10 ms':>10s} {'diff ms':>9s} {'calls':>13s}")
    for diff, op in sorted(rows, key=lambda row: -abs(row[0]))[:top]:
        (s_us, s_calls), (e_us, e_calls) = static.get(op, [0, 0]), elastic.get(op, [0, 0])
        print(f"{op:42s} {s_us / 1e3:10.1f} {e_us / 1e3:10.1f} {diff:+9.1f} {s_calls:6d}/{e_calls:<6d}")
    return {"totals_ms": totals, "top": [(op, diff) for diff, op in sorted(rows, key=lambda row: -abs(row[0]))[:top]]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=4, help="steps left out of the steady-state rate")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--experts-impl", default=None, help="swift's --experts_impl (default: transformers' own)")
    parser.add_argument("--hidden", type=int, default=MODEL["hidden_size"], help="hidden size H")
    parser.add_argument("--ffn", type=int, default=MODEL["intermediate_size"], help="expert FFN width F")
    parser.add_argument("--layers", type=int, default=MODEL["num_hidden_layers"])
    parser.add_argument("--profile", default=None, metavar="FIRST:COUNT",
                        help="profile steps FIRST+1..FIRST+COUNT of one run per schedule instead of timing rounds")
    args = parser.parse_args(argv)
    model = {**MODEL, "hidden_size": args.hidden, "intermediate_size": args.ffn, "num_hidden_layers": args.layers}
    work = args.work or Path(tempfile.mkdtemp(prefix="elastic_moe_swift_speed_"))
    model_dir, dataset = build(work, model)
    if args.profile is not None:
        print(json.dumps(profile_differences(model_dir, dataset, work, args.steps, args.experts_impl, args.profile)))
        return 0
    rates: dict[str, list[float]] = {schedule: [] for schedule in SCHEDULES}
    kappa: dict[str, list[float]] = {schedule: [] for schedule in SCHEDULES}
    for round_index in range(args.rounds):
        order = SCHEDULES if round_index % 2 == 0 else SCHEDULES[::-1]
        for schedule in order:
            out = work / f"{schedule}_{round_index}"
            out.mkdir(parents=True)
            rows = run(model_dir, dataset, schedule, args.steps, out, args.experts_impl)
            rate = steady_steps_per_second(rows, args.warmup)
            rates[schedule].append(rate)
            means = [row["elastic_moe/mean_kappa"] for row in rows if "elastic_moe/mean_kappa" in row]
            kappa[schedule] += means
            logged = f"{statistics.fmean(means):.3f}" if means else "- (static: not logged)"
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

"""Megatron-LM's own training loop with the plugin, for real: ``megatron.training.pretrain``.

``examples/megatron_lm/pretrain_gpt_moe.py`` (the project's own script: Megatron's argument
parsing, ``initialize_megatron``, GPT model builder, ``train_step``, ``training_log``, torch_dist
checkpoints, mock data) runs under torchrun on gloo, on CPU, through the documented front door,
``python -m elastic_moe_plugin.megatron_lm --cpu``: one run as that very command, the others through
``tests/fixtures/megatron_lm/run_on_cpu.py``, which calls the same entry point with ``--cpu`` and adds
the test-only observer (``--stock`` runs the script without the plugin, on the same CPU runtime).
What the trainer adds is proven here: its loss lines, checkpoints, resume, logging and TP=2 with
sequence parallelism; activation recompute, expert parallelism, layer selection and each SP shard's
own κ are proven at the router and layer in ``test_mcore_parallel.py``, ``test_mcore_gpt.py`` and
``test_mcore_selection.py``, and through this trainer by ``test_megatron_lm_kappa_stream.py`` (DP=4,
EP=2) and ``test_megatron_lm_hybrid.py`` (a layer selection).
A tiny MoE GPT: 2 layers, 4 experts, top-2, alltoall dispatcher, aux loss; 10 iterations of
2 micro-batches of 4 x 32 tokens; dropout off (under the CPU emulation dropout shares the CPU
generator with data loading, so even stock Megatron would not resume bit-exactly with it on).

The eight runs start with the module's first test, two processes at a time (each takes 10-20 s,
mostly imports), and the tests read their logs, TensorBoard event
files, checkpoints and, through ``RUN_ON_CPU_OBSERVE``, the experts per token each router handed
its dispatcher.

megatron-core 0.16.1's wheel ships no ``megatron.training``; under the 0.16.1 pass the one on the
path is the 0.19.2 wheel's, which needs megatron.core 0.19, so this module skips there (the router,
tracker and budget-stream tests of the other modules run on both).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from elastic_moe_plugin import ElasticConfig
from elastic_moe_plugin.core.schedule import BudgetSchedule

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "megatron_lm" / "pretrain_gpt_moe.py"
LAUNCHER = REPO / "tests" / "fixtures" / "megatron_lm" / "run_on_cpu.py"

LAYERS, EXPERTS, TOPK, SEQ, MICRO_BATCH, GLOBAL_BATCH, ITERS = 2, 4, 2, 32, 4, 8, 10
TOKENS_PER_FORWARD = MICRO_BATCH * SEQ  # per rank and micro-batch
SCHEDULE = "1-3"  # around k = 2
MEGATRON_ARGS = [
    "--num-layers", str(LAYERS), "--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "64",
    "--num-experts", str(EXPERTS), "--moe-router-topk", str(TOPK), "--moe-ffn-hidden-size", "32",
    "--moe-token-dispatcher-type", "alltoall", "--moe-router-load-balancing-type", "aux_loss",
    "--moe-aux-loss-coeff", "0.01", "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ),
    "--micro-batch-size", str(MICRO_BATCH), "--global-batch-size", str(GLOBAL_BATCH), "--train-iters", str(ITERS),
    "--lr", "1e-3", "--seed", "1234", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
    "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000", "--num-workers", "0",
    "--hidden-dropout", "0", "--attention-dropout", "0",
    # CPU: gloo, no fused kernels or Transformer Engine (see elastic_moe_plugin.cpu_runtime)
    "--distributed-backend", "gloo", "--transformer-impl", "local", "--use-cpu-initialization",
    "--no-gradient-accumulation-fusion", "--no-persist-layer-norm", "--no-bias-gelu-fusion", "--disable-bias-linear",
    "--clip-grad", "0",
]
ELASTIC = ["--elastic-moe-schedule", SCHEDULE]
POINT_MASS = ["--elastic-moe-schedule", "2-2"]  # elastic routing with κ ≡ k: no draw decides anything
# The TP=2 comparison: a vocabulary padded to a multiple of 64·TP gives 128 rows at TP 1 and 2 alike
# (the default 128·TP would pad TP=2 to 256, another model); 3 iterations of the 10-iteration schedule.
SHORT = ["--exit-interval", "3", "--save-interval", "3", "--make-vocab-size-divisible-by", "64"]
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]


def _skip_reason() -> str | None:
    import importlib.util

    core, training = importlib.util.find_spec("megatron.core"), importlib.util.find_spec("megatron.training")
    if core is None:
        return "megatron-core is not installed"
    if training is None:
        return "this megatron-core ships no megatron.training"
    if Path(core.origin).parents[1] != Path(training.origin).parents[1]:
        return (f"megatron.training ({Path(training.origin).parents[1]}) is not the one of the imported "
                f"megatron.core ({Path(core.origin).parents[1]}): the megatron-core 0.16.1 wheel ships no "
                f"megatron.training, and the 0.19.2 wheel's needs megatron.core 0.19")
    return None


pytestmark = [pytest.mark.megatron, pytest.mark.slow]
if _skip_reason():
    pytestmark.append(pytest.mark.skip(reason=_skip_reason()))


# ====================================================================================== the runs
@dataclasses.dataclass
class Run:
    args: list[str]
    nproc: int = 1
    stock: bool = False
    after: tuple[str, ...] = ()  # runs whose checkpoints this one loads
    front_door: bool = False  # the documented command itself, not the launcher (no observer)
    env: tuple[tuple[str, str], ...] = ()


#: Megatron's switch for per-layer MoE metrics (its aux losses', and the plugin's routing metrics)
PER_LAYER_LOGGING = ["--moe-per-layer-logging"]


def _runs(tmp: Path) -> dict[str, Run]:
    ckpt = {name: str(tmp / f"ckpt_{name}") for name in ("stock", "elastic")}
    return {
        "stock": Run(["--exit-interval", "4", "--save", ckpt["stock"], "--save-interval", "4",
                      "--tensorboard-dir", str(tmp / "tb_stock"), *PER_LAYER_LOGGING], stock=True),
        "static": Run(["--exit-interval", "4", "--elastic-moe-schedule", "static"]),
        "elastic": Run([*ELASTIC, "--save", ckpt["elastic"], "--save-interval", "5", "--tensorboard-dir", str(tmp / "tb_elastic"),
                        *PER_LAYER_LOGGING]),
        "resumed": Run([*ELASTIC, "--load", ckpt["elastic"], "--ckpt-step", "5"], after=("elastic",)),
        # ... logging the layer means only, though Megatron logs its own MoE metrics per layer here
        "static_to_elastic": Run([*ELASTIC, "--load", ckpt["stock"], "--exit-interval", "6", "--tensorboard-dir",
                                  str(tmp / "tb_means"), *PER_LAYER_LOGGING], after=("stock",),
                                 env=(("ELASTIC_MOE_LOG_METRICS", "means"),)),
        "front_door": Run([*ELASTIC, *SHORT, "--save", str(tmp / "ckpt_front_door"),
                           "--tensorboard-dir", str(tmp / "tb_front_door")], front_door=True),
        # κ ≡ 2 through the elastic router: the same κ on 1 rank and on the SP shards, so the two must train
        # alike; with the routing metrics turned off in the entry point's old spelling (false is 'off')
        "point_mass": Run([*POINT_MASS, *SHORT, "--save", str(tmp / "ckpt_point_mass"),
                           "--elastic-moe-log-metrics", "false"]),
        # Megatron requires CUDA_DEVICE_MAX_CONNECTIONS=1 with TP > 1 on GPUs before Blackwell, and so on CPU
        "tp2_sp_point_mass": Run([*POINT_MASS, *SHORT, *TP2_SP, "--save", str(tmp / "ckpt_tp2_sp_point_mass")],
                                 nproc=2, env=(("CUDA_DEVICE_MAX_CONNECTIONS", "1"),)),
    }


@dataclasses.dataclass
class Result:
    name: str
    returncode: int
    output: str
    observed: dict[int, dict[int, list[list[int]]]]  # rank -> layer -> per forward: bincount of experts per token

    def lines(self) -> dict[int, str]:
        """{iteration: Megatron's console line} without its timestamp and timing."""
        found = {}
        for line in self.output.splitlines():
            match = re.search(r"\biteration\s+(\d+)/\s*\d+ \|(.*)$", line)
            if match:
                found[int(match.group(1))] = re.sub(r" elapsed time per iteration \(ms\): [\d.]+ \|", "", match.group(2))
        return found

    def value(self, iteration: int, name: str) -> float:
        return float(re.search(rf" {re.escape(name)}: ([^ |]+) \|", self.lines()[iteration]).group(1))


def _environment() -> dict[str, str]:
    drop = ("ELASTIC_MOE_", "MASTER_", "TORCHELASTIC_", "PET_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    # CUDA_VISIBLE_DEVICES empty: on a GPU machine --cpu refuses a visible GPU; hiding it is its documented fix
    env.update(TORCH_COMPILE_DISABLE="1", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", NO_VCS_VERSION="1",
               CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
    return env


def _start(name: str, run: Run, tmp: Path) -> subprocess.Popen:
    entry = ["-m", "elastic_moe_plugin.megatron_lm", "--cpu"] if run.front_door else [
        str(LAUNCHER), *(["--stock"] if run.stock else [])]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(run.nproc),
               *entry, str(SCRIPT), *MEGATRON_ARGS, *run.args]
    env = {**_environment(), "RUN_ON_CPU_OBSERVE": str(tmp / f"observed_{name}"), **dict(run.env)}
    with open(tmp / f"{name}.log", "w") as log:  # a file, not a pipe: nobody reads a pipe while runs overlap
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp)


def _collect(name: str, process: subprocess.Popen, tmp: Path) -> Result:
    process.wait()
    output = (tmp / f"{name}.log").read_text()
    observed = {}
    for path in tmp.glob(f"observed_{name}.*"):
        observed[int(path.suffix[1:])] = {int(layer): forwards for layer, forwards in json.loads(path.read_text()).items()}
    return Result(name, process.returncode, output, observed)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Result]:
    """Every run, two processes at a time, each started once the checkpoints it loads exist."""
    tmp = tmp_path_factory.mktemp("megatron_lm")
    pending, running, done = dict(_runs(tmp)), {}, {}
    deadline = time.monotonic() + 900
    while pending or running:
        for name, (process, run) in list(running.items()):
            if process.poll() is not None:
                done[name] = _collect(name, process, tmp)
                del running[name]
        busy = sum(run.nproc for _, run in running.values())
        for name, run in list(pending.items()):
            if all(dep in done for dep in run.after) and (busy == 0 or busy + run.nproc <= 2):
                running[name] = (_start(name, run, tmp), run)
                busy += run.nproc
                del pending[name]
        if time.monotonic() > deadline:
            for process, _ in running.values():
                process.kill()
            pytest.fail(f"Megatron-LM runs still running after 15 minutes: {sorted(running)}")
        time.sleep(0.2)
    done["tmp"] = tmp
    return done


def _ok(runs, name) -> Result:
    result = runs[name]
    assert result.returncode == 0, f"run {name!r} failed (exit {result.returncode}):\n{result.output[-6000:]}"
    return result


def _schedule() -> BudgetSchedule:
    return ElasticConfig(schedule=SCHEDULE).budget_schedule(TOPK)


# ====================================================================================== static == stock
def test_static_prints_the_loss_lines_of_stock_megatron_digit_for_digit(runs):
    stock, static = _ok(runs, "stock").lines(), _ok(runs, "static").lines()
    assert sorted(stock) == sorted(static) == [1, 2, 3, 4]
    for iteration in stock:
        assert static[iteration] == stock[iteration], f"iteration {iteration}"
        assert "lm loss:" in stock[iteration] and "load_balancing_loss:" in stock[iteration]
        assert "elastic_moe/" not in static[iteration]
    assert "elastic-moe: ElasticConfig(schedule='static'" in runs["static"].output


# ====================================================================================== elastic κ
def test_elastic_kappa_follows_the_pmf_and_the_dispatcher_saw_one_to_three_experts(runs):
    elastic = _ok(runs, "elastic")
    schedule = _schedule()
    assert sorted(elastic.lines()) == list(range(1, ITERS + 1))
    for layer in range(LAYERS):
        forwards = elastic.observed[0][layer]
        assert len(forwards) == ITERS * GLOBAL_BATCH // MICRO_BATCH
        totals = [sum(column) for column in zip(*forwards)]
        tokens = sum(totals)
        assert tokens == len(forwards) * TOKENS_PER_FORWARD
        assert totals[0] == 0 and all(count == 0 for count in totals[schedule.high + 1:]), totals
        for budget, probability in zip(schedule.budgets, schedule.pmf):
            observed = totals[budget] / tokens
            sd = math.sqrt(probability * (1 - probability) / tokens)
            assert abs(observed - probability) < 4 * sd, f"layer {layer}, κ={budget}: {observed:.4f} vs {probability:.4f}"
        mean = sum(budget * totals[budget] for budget in schedule.budgets) / tokens
        assert abs(mean - TOPK) < 0.1


def test_the_console_line_carries_the_routing_metrics(runs):
    elastic = _ok(runs, "elastic")
    for iteration in range(1, ITERS + 1):
        line = elastic.lines()[iteration]
        moe_section = line[line.index("load_balancing_loss:"):line.index("loss scale:")]
        for name in ("mean_kappa", "retained_weight_sum_mean", "tokens_per_expert_max_over_mean", "topk_set_changed_frac"):
            assert f" elastic_moe/{name}: " in moe_section, line
        # this step's two forwards, both layers (log interval 1: the histograms cover one step)
        forwards = [elastic.observed[0][layer][2 * iteration - 2: 2 * iteration] for layer in range(LAYERS)]
        per_layer = [sum(b * sum(f[b] for f in layer) for b in range(EXPERTS + 1)) / (2 * TOKENS_PER_FORWARD)
                     for layer in forwards]
        assert elastic.value(iteration, "elastic_moe/mean_kappa") == pytest.approx(sum(per_layer) / LAYERS, abs=0.005)


# ====================================================================================== log_metrics
def test_log_metrics_means_writes_the_layer_means_only_even_with_megatrons_per_layer_switch(runs):
    """``ELASTIC_MOE_LOG_METRICS=means`` with ``--moe-per-layer-logging``: TensorBoard gets the layer mean
    of every name but the schedule's constants and no per-layer value of ours, at every step, while
    Megatron's own MoE metrics stay per layer."""
    from elastic_moe_plugin.core.metrics import is_schedule_constant, metric_names

    to_elastic = _ok(runs, "static_to_elastic")
    assert "routing metrics in Megatron-LM's log: layer means (ELASTIC_MOE_LOG_METRICS=means)" in to_elastic.output
    scalars = _scalars(runs["tmp"] / "tb_means")
    means = {f"elastic_moe/{name}" for name in metric_names(_schedule(), EXPERTS) if not is_schedule_constant(name)}
    assert {tag for tag in scalars if "elastic_moe" in tag} == means and len(means) <= 40
    assert all(sorted(scalars[tag]) == [5, 6] for tag in means)
    assert {f"moe/load_balancing_loss_layer_{layer}" for layer in range(LAYERS)} <= set(scalars)


def test_log_metrics_off_leaves_megatrons_line_as_it_is(runs):
    """The entry point's old spelling ``--elastic-moe-log-metrics false`` is ``log_metrics='off'``
    (echoed as typed): no hook, so no ``elastic_moe/`` field on any console line."""
    quiet = _ok(runs, "point_mass")
    assert "no routing metrics in Megatron-LM's log (--elastic-moe-log-metrics false)" in quiet.output
    assert "log_metrics='off'" in quiet.output
    assert sorted(quiet.lines()) == [1, 2, 3] and not [line for line in quiet.lines().values() if "elastic_moe/" in line]


# ====================================================================================== checkpoints
def test_resume_continues_the_uninterrupted_run_exactly(runs):
    """Every line of the resumed run equals the uninterrupted run's, but one: Megatron-LM logs the
    first iteration of a run without resetting its loss accumulators, so a run's second line shows
    the mean of its first two iterations (iteration 2 of the uninterrupted run, 7 of the resumed)."""
    elastic, resumed = _ok(runs, "elastic"), _ok(runs, "resumed")
    assert sorted(resumed.lines()) == list(range(6, ITERS + 1))
    for iteration in (6, *range(8, ITERS + 1)):
        assert resumed.lines()[iteration] == elastic.lines()[iteration], f"iteration {iteration}"
    for name in ("lm loss", "load_balancing_loss"):
        mean = (elastic.value(6, name) + elastic.value(7, name)) / 2
        assert resumed.value(7, name) == pytest.approx(mean, rel=2e-6), name
    without_losses = re.compile(r" (lm loss|load_balancing_loss): [^ |]+ \|")
    assert without_losses.sub("", resumed.lines()[7]) == without_losses.sub("", elastic.lines()[7])
    # the κ histograms of every forward after the checkpoint (2 per iteration), both layers
    assert resumed.observed[0] == {layer: forwards[10:] for layer, forwards in elastic.observed[0].items()}


def _tensor_shapes(checkpoint: Path) -> dict[str, tuple[int, ...] | None]:
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    return {key: tuple(getattr(entry, "size", ())) or None for key, entry in metadata.items()}


def test_checkpoints_have_stock_keys_and_shapes_and_load_across_schedules(runs):
    _ok(runs, "stock"), _ok(runs, "elastic")
    tmp = runs["tmp"]
    stock = _tensor_shapes(tmp / "ckpt_stock" / "iter_0000004")
    elastic = _tensor_shapes(tmp / "ckpt_elastic" / "iter_0000005")
    assert len(stock) > 10 and stock == elastic
    # a stock checkpoint fine-tuned elastically (an elastic one served static: the keys are stock's)
    to_elastic = _ok(runs, "static_to_elastic")
    assert sorted(to_elastic.lines()) == [5, 6]
    assert all(math.isfinite(to_elastic.value(i, "lm loss")) for i in to_elastic.lines())
    assert all(len([c for c in counts if c]) == 3 for layer in to_elastic.observed[0].values() for counts in layer)


# ====================================================================================== TensorBoard
def _scalars(directory: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars: dict[str, dict[int, float]] = {}
    for events in directory.glob("events.out.tfevents.*"):
        accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0})
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            scalars.setdefault(tag, {}).update({event.step: event.value for event in accumulator.Scalars(tag)})
    return scalars


def test_routing_metrics_reach_the_tensorboard_event_files(runs):
    from elastic_moe_plugin.core.metrics import metric_names

    elastic, _ = _ok(runs, "elastic"), _ok(runs, "stock")
    ours, stock = _scalars(runs["tmp"] / "tb_elastic"), _scalars(runs["tmp"] / "tb_stock")
    names = metric_names(_schedule(), EXPERTS)
    expected = {f"elastic_moe/{name}" for name in names} | {
        f"moe/elastic_moe/{name}_layer_{layer}" for name in names for layer in range(LAYERS)}
    assert {tag for tag in ours if "elastic_moe" in tag} == expected
    assert set(stock) == set(ours) - expected, "Megatron's own tags must be unchanged"
    assert all(sorted(ours[tag]) == list(range(1, ITERS + 1)) for tag in expected)
    print(f"TensorBoard tags: stock {len(stock)}, with the plugin {len(ours)} ({len(expected)} elastic_moe)")
    # per step and layer, the logged κ shares are the step's histogram (log interval 1)
    for layer in range(LAYERS):
        for step in range(1, ITERS + 1):
            forwards = elastic.observed[0][layer][2 * step - 2: 2 * step]
            for budget in _schedule().budgets:
                share = sum(f[budget] for f in forwards) / (2 * TOKENS_PER_FORWARD)
                assert ours[f"moe/elastic_moe/kappa_frac_{budget}_layer_{layer}"][step] == pytest.approx(share, abs=1e-6)


# ====================================================================================== the CPU front door
def test_the_documented_cpu_command_trains_with_kappa_spread_over_one_to_three(runs):
    """``torchrun ... -m elastic_moe_plugin.megatron_lm --cpu SCRIPT ... --elastic-moe-schedule 1-3``
    on 1 rank, 3 iterations: the banner, the κ metrics on every console line, and per step the κ
    shares Megatron's TensorBoard writer received, layer means (no ``--moe-per-layer-logging``):
    each of 1, 2, 3 drawn, nothing else, their E[κ] the console's mean κ."""
    run = _ok(runs, "front_door")
    assert "elastic-moe: --cpu: Megatron runs on the CPU" in run.output
    assert "elastic-moe: ElasticConfig(schedule='1-3'" in run.output
    lines = run.lines()
    assert sorted(lines) == [1, 2, 3]
    for iteration, line in lines.items():
        assert math.isfinite(run.value(iteration, "lm loss")), line
        for name in ("mean_kappa", "retained_weight_sum_mean", "tokens_per_expert_max_over_mean", "topk_set_changed_frac"):
            assert f" elastic_moe/{name}: " in line, line
    scalars = _scalars(runs["tmp"] / "tb_front_door")
    budgets = _schedule().budgets
    assert list(budgets) == [1, 2, 3]
    assert not [tag for tag in scalars if "_layer_" in tag]  # Megatron's default: layer means only
    for step in (1, 2, 3):
        shares = {b: scalars[f"elastic_moe/kappa_frac_{b}"][step] for b in budgets}
        assert all(share > 0 for share in shares.values()), (step, shares)
        assert sum(shares.values()) == pytest.approx(1.0, abs=1e-6)
        # the console prints the layer mean of E[κ] to 2 decimals, E[κ] of the mean shares
        assert run.value(step, "elastic_moe/mean_kappa") == pytest.approx(sum(b * share for b, share in shares.items()),
                                                                           abs=0.005 + 1e-6)
        assert scalars["elastic_moe/mean_kappa"][step] == pytest.approx(sum(b * s for b, s in shares.items()), abs=1e-5)


def _checkpoint_tensors(checkpoint: Path) -> dict:
    """The model tensors of a torch_dist checkpoint, at their global shapes (TP shards reassembled)."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = FileSystemReader(str(checkpoint))
    metadata = reader.read_metadata().state_dict_metadata
    tensors = {key: torch.empty(entry.size, dtype=entry.properties.dtype) for key, entry in metadata.items()
               if isinstance(entry, TensorStorageMetadata) and "optimizer" not in key and "_extra_state" not in key}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        load(tensors, storage_reader=reader, no_dist=True)
    return tensors


def test_tp2_with_sequence_parallel_on_two_gloo_ranks_trains_as_one_rank(runs):
    """TP=2 with sequence parallelism (the CPU runtime's sequence-parallel torch norm) equals the
    1-rank run of the same model, data and κ.

    κ is the same on both sides only where no draw decides it: with SP each TP rank is its own token
    shard and draws its own κ from its own key (``docs/parallelism.md#randomness``), so an elastic
    1-3 run on 2 SP ranks routes other κ than on 1 rank. The exact comparison therefore runs elastic
    routing at κ ≡ 2 (schedule 2-2: the elastic router, its dispatch and its realised aux loss, whose
    counts are reduced over TP); ``test_mcore_parallel.py``'s
    ``test_tp2_with_sequence_parallel_matches_a_single_process`` checks each shard's own κ.

    - Parameters after 3 iterations, every tensor, max abs error <= 2e-5: fp32, and the TP=2 run sums
      its row-parallel partials and the vocab-parallel cross entropy across ranks in another order.
      Measured <= 3.6e-6 (Adam turns ~1e-7 noise on near-zero expert gradients into that); with the
      norms' ``sequence_parallel`` mark removed (their gradients then not all-reduced over TP) the
      same comparison measured >= 8e-5 for every tensor and ~3e-3 for the norms.
    - The loss lines: lm loss and load-balancing loss within rel 1e-6 (measured equal in all 7 printed
      digits; the unmarked norms move iteration 2 by 3.7e-6), the grad norm to its 3 printed decimals.
    """
    one, two = _ok(runs, "point_mass"), _ok(runs, "tp2_sp_point_mass")
    assert "tensor-model-parallel size: 2" in two.output
    assert sorted(two.lines()) == [1, 2, 3]
    for iteration in (1, 2, 3):
        for name in ("lm loss", "load_balancing_loss"):
            assert two.value(iteration, name) == pytest.approx(one.value(iteration, name), rel=1e-6), (iteration, name)
        assert two.value(iteration, "grad norm") == pytest.approx(one.value(iteration, "grad norm"), abs=1.5e-3)
    for rank in (0, 1):
        for layer in range(LAYERS):
            assert all(counts == [0, 0, TOKENS_PER_FORWARD // 2, 0, 0] for counts in two.observed[rank][layer])
    reference = _checkpoint_tensors(runs["tmp"] / "ckpt_point_mass" / "iter_0000003")
    tensors = _checkpoint_tensors(runs["tmp"] / "ckpt_tp2_sp_point_mass" / "iter_0000003")
    assert sorted(tensors) == sorted(reference) and any("layer_norm_weight" in key for key in tensors)
    for key, tensor in tensors.items():
        assert tensor.shape == reference[key].shape, key
        assert (tensor.float() - reference[key].float()).abs().max().item() <= 2e-5, key



"""End to end: real ``megatron sft`` runs (Megatron-SWIFT, ms-swift 4.6 + mcore-bridge) on CPU.

Every run is the ``megatron`` console script of this environment, started as a user starts it,
on a tiny random Qwen3-MoE built offline (``tests/swift/_tiny_assets.py``: ``qwen3_moe_k2``, 2
layers, 8 experts, top-2, renormalised gate). ``megatron sft`` re-launches itself under torchrun
(``NPROC_PER_NODE``); the CPU runtime reaches every one of those processes through the start-up
bootstrap ``elastic_moe_plugin/tools/child_bootstrap`` first on ``PYTHONPATH`` (``EMOE_BOOTSTRAP=megatron_swift``)
(:mod:`elastic_moe_plugin.cpu_runtime.megatron_swift`). A second ``sitecustomize`` of the run
(written below, run by the bootstrap after it) installs ``_megatron_observer.py``, which records
every router forward, and, for the ``--plugin elastic_moe`` runs, activates the checkout's ms-swift
start-up hook as a wheel install would.

The runs (two processes at a time, ``_jobs.py``; 4 steps of one micro-batch of 2 rows x 192 tokens
unless said otherwise):

- ``stock``: no plugin; ``static``: the plugin with ``ELASTIC_MOE_SCHEDULE=static``;
- ``elastic``: ``--plugin elastic_moe``, schedule 1-3 around top-2, saving after steps 2 and 4
  (with optimizer and RNG state); ``resume``: the same from the step-2 checkpoint, steps 3-4;
- expert and pipeline parallelism under ``megatron sft`` run in the rehearsal of the Qwen3 recipe
  (``test_rehearse.py``: PP 2 x EP 2 x DP 2); the layers each stage routes, in ``test_mcore_parallel.py``;
- ``export``: ``megatron export --to_hf`` (ms-swift 4.6's converter back to Hugging Face) of the
  elastic checkpoint; ``mg_forward``: Megatron's static forward of that checkpoint
  (``_megatron_forward.py``); ``hf``: the exported checkpoint in plain transformers, plugin
  unimportable (``_hf_logits.py``);
- ``minimax_m2``: a tiny MiniMax-M2 (``minimax_m2``, 2 layers, top-2 of 8; its ``config.json``
  carries the real checkpoint's ``scoring_func: sigmoid`` and ``use_qk_norm: true``, without which
  mcore-bridge silently builds a different model: a softmax router, no expert bias, no q/k norms),
  ``--plugin elastic_moe`` with 1-3 in layer 1 only (``ELASTIC_MOE_LAYERS=1``), the observer
  replaying stock routing on every router forward.

One MiniMax-M2 run stands in for its own stock/static/elastic trio (each ``megatron sft`` process
costs about 30 CPU-seconds). The Qwen3-MoE pair proves what holds for every model: a static
schedule leaves a whole ``megatron sft`` run stock, loss and gradients digit for digit, since the
patched ``TopKRouter.routing`` runs the original method wherever a layer is static. What is
MiniMax-M2's own is its router (mcore-bridge's ``TopKRouter`` subclass: sigmoid scores, an expert
bias updated from the counts the router records), and in that run the observer calls the stock
method (``TopKRouter.routing.__wrapped__``) on the router's own logits after each training forward,
gradients off so that nothing is recorded twice: static layer 0 returns stock's weights and map bit
for bit on every step, while layer 1 draws κ at the pmf and keeps stock's experts and weights on
its κ = k tokens.

Under megatron-core 0.16 (the CI's second pass, ``-m megatron``) only ``stock``, ``static`` and
``elastic`` run, with their assertions: that pass checks the 0.16 code paths of the CPU runtime and
of the adapter, within the CI's time budget; the rest runs on 0.19.2.

``MEGATRON_SFT_TEST_DEVICE=cuda`` runs the same runs and assertions on GPUs with the recipe's layout
(``scripts/gpu_check.sh`` does): Transformer Engine and grouped-GEMM experts
(``--moe_grouped_gemm true``), no CPU runtime; float32 weights, TE's unfused attention and no
padding-free batches, so that the exact stock/static comparison and the float32 export tolerance
keep their meaning. Not run so far:
no GPU has been available to this project.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
from pathlib import Path

import pytest

from elastic_moe_plugin.core.config import ElasticConfig

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

_MISSING = [name for name in ("swift", "mcore_bridge", "megatron.core", "transformers") if importlib.util.find_spec(name) is None]
DEVICE = os.environ.get("MEGATRON_SFT_TEST_DEVICE", "cpu")
pytestmark = [pytest.mark.swift, pytest.mark.megatron, pytest.mark.slow]
if _MISSING:
    pytestmark.append(pytest.mark.skip(reason=f"megatron sft needs {', '.join(_MISSING)} (make setup installs them)"))
if DEVICE not in ("cpu", "cuda"):
    raise pytest.UsageError(f"MEGATRON_SFT_TEST_DEVICE={DEVICE!r}: expected cpu or cuda")


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if DEVICE == "cuda" else 0


if DEVICE == "cuda" and not _MISSING and _gpus() < 1:
    pytestmark.append(pytest.mark.skip(reason="MEGATRON_SFT_TEST_DEVICE=cuda but no GPU is visible"))


def _megatron_core_016() -> bool:
    import importlib.metadata

    from packaging.version import Version

    try:
        return Version(importlib.metadata.version("megatron-core")) < Version("0.17")
    except importlib.metadata.PackageNotFoundError:
        return False


MCORE_016 = _megatron_core_016()
CORE_RUNS = ("stock", "static", "elastic")
needs_full_pass = pytest.mark.skipif(MCORE_016, reason="megatron-core 0.16 pass: the core runs only (the CI time "
                                                      "budget); this one runs on 0.19.2")

MODEL = "qwen3_moe_k2"
#: the tiny MiniMax-M2 (tests/swift/_tiny_assets.py) and the layers its run routes elastically
MINIMAX, MINIMAX_ELASTIC = "minimax_m2", (1,)
#: model -> (megatron sft --model_type, --template)
MODEL_TYPES = {MODEL: ("qwen3_moe", "qwen3"), MINIMAX: ("minimax_m2", "minimax_m2")}
TOPK, NUM_EXPERTS, LAYERS = 2, 8, (0, 1)
SCHEDULE = "1-3"
STEPS, MICRO_BATCH, MAX_LENGTH = 4, 2, 192
LR = "1e-3"  # large enough that 4 steps move every weight far beyond the export tolerance
Z = 4.0  # per-budget z-bound of the κ histograms (below)
EXPORT_ATOL = 1e-5  # fp32 logits, Megatron vs transformers (test_the_exported_checkpoint_...)

BOOTSTRAP = ROOT / "elastic_moe_plugin" / "tools" / "child_bootstrap"  # with EMOE_BOOTSTRAP=megatron_swift
OBSERVER = HERE / "_megatron_observer.py"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_elastic_moe_tests_swift_{name}", HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


_jobs = _load("_jobs")


#: the recipe's GPU layout (grouped-GEMM experts under Transformer Engine), in float32
GPU_FLAGS = ["--moe_grouped_gemm", "true", "--moe_permute_fusion", "false", "--torch_dtype", "float32", "--bf16", "false",
             "--fp16", "false", "--attention_backend", "unfused", "--padding_free", "false"]


#: Megatron's switch for per-layer MoE logging: the callback then logs every layer's metrics too
PER_LAYER_LOGGING = {"moe_per_layer_logging": True}


def _device_flags(megatron_extra_kwargs: dict | None = None) -> list[str]:
    """The device's flags; ``megatron_extra_kwargs`` joins the CPU flags' own (one flag, one JSON)."""
    extra = dict(megatron_extra_kwargs or {})
    if DEVICE == "cuda":
        flags = list(GPU_FLAGS)
    else:
        from elastic_moe_plugin.cpu_runtime.megatron_swift import CPU_FLAGS

        flags = []
        for flag, (value, _) in CPU_FLAGS.items():
            if flag == "megatron_extra_kwargs":
                extra = {**json.loads(value), **extra}
            else:
                flags += [f"--{flag}", value]
    return flags + (["--megatron_extra_kwargs", json.dumps(extra)] if extra else [])


def _schedule():
    return ElasticConfig(schedule=SCHEDULE).resolve(num_experts=NUM_EXPERTS, topk=TOPK, num_layers=len(LAYERS))


def _megatron() -> str:
    script = Path(sys.executable).with_name("megatron")
    return str(script) if script.exists() else "megatron"


# ================================================================================== the runs
class Run:
    """One job's result plus what its files say."""

    def __init__(self, result, work: Path):
        self.result, self.work = result, work

    @property
    def ok(self) -> bool:
        return self.result.returncode == 0

    @property
    def output(self) -> str:
        return self.result.output

    def rows(self) -> list[dict]:
        """Megatron-SWIFT's ``logging.jsonl`` rows of training steps."""
        path = self.work / "out" / "logging.jsonl"
        if not path.exists():
            return []
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return [row for row in rows if "loss" in row and "iteration" in row]

    def records(self) -> dict[int, list[dict]]:
        """rank -> the observer's router records, in order."""
        found = {}
        for path in sorted(self.work.glob("observed.*.jsonl")):
            rank = int(path.name.split(".")[1])
            found[rank] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return found

    def forwards(self, rank: int = 0) -> list[dict]:
        return [record for record in self.records().get(rank, []) if "layer" in record]

    def te_report(self, rank: int = 0) -> dict:
        return next(record["te"] for record in self.records()[rank] if "te" in record)


def _site(work: Path, hook: bool, replay: bool = False) -> Path:
    """The run's second ``sitecustomize``: the observer (``replay``: replaying stock routing), and the
    ms-swift start-up hook if asked."""
    site_dir = work / "site"
    site_dir.mkdir(parents=True)
    lines = [
        "import importlib.util, site",
        f"spec = importlib.util.spec_from_file_location('_elastic_moe_tests_megatron_observer', {str(OBSERVER)!r})",
        "observer = importlib.util.module_from_spec(spec)",
        "spec.loader.exec_module(observer)",
        f"observer.install({str(work / 'observed')!r}, replay_stock={replay})",
    ]
    if hook:
        hook_dir = site_dir / "hook"
        hook_dir.mkdir()
        (hook_dir / "elastic-moe-swift.pth").write_bytes((ROOT / "elastic-moe-swift.pth").read_bytes())
        lines.append(f"site.addsitedir({str(hook_dir)!r})")
    (site_dir / "sitecustomize.py").write_text("\n".join(lines) + "\n")
    return site_dir


def _env(base: dict[str, str], work: Path, *, hook: bool = False, replay: bool = False, nproc: int | None = 1,
         **extra: str) -> dict[str, str]:
    bootstrap = [str(BOOTSTRAP)] if DEVICE == "cpu" else []  # the CPU runtime, in every process of the run
    path = [*bootstrap, str(_site(work, hook, replay)), str(ROOT), *filter(None, [base.get("PYTHONPATH")])]
    env = {**base, "PYTHONPATH": os.pathsep.join(path), **extra}
    if DEVICE == "cpu":
        env["EMOE_BOOTSTRAP"] = "megatron_swift"
    if DEVICE == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(nproc or 1))
    if nproc is not None:
        env.update(NPROC_PER_NODE=str(nproc), MASTER_PORT=str(_jobs.free_port()))
    return env


PLUGIN = {"path": ["--external_plugins", "patches/elastic_moe.py", "--callbacks", "elastic_moe"],
          "--plugin": ["--plugin", "elastic_moe"], "none": []}


def _sft(assets, work: Path, plugin: str, *, steps: int = STEPS, global_batch: int = MICRO_BATCH,
         extra: tuple[str, ...] = (), per_layer: bool = False, model: str = MODEL) -> list[str]:
    model_type, template = MODEL_TYPES[model]
    return [
        _megatron(), "sft", "--model", str(assets.model_dir(model)), "--model_type", model_type, "--template", template,
        "--dataset", str(assets.dataset), "--split_dataset_ratio", "0", "--check_model", "false",
        *PLUGIN[plugin],
        "--tuner_type", "full", "--finetune", "true", "--micro_batch_size", str(MICRO_BATCH),
        "--global_batch_size", str(global_batch), "--max_length", str(MAX_LENGTH), "--truncation_strategy", "left",
        "--train_iters", str(steps), "--logging_steps", "1", "--lr", LR, "--min_lr", "1e-4",
        "--moe_aux_loss_coeff", "0.01", "--clip_grad", "1.0", "--moe_token_dispatcher_type", "alltoall",
        "--dataset_num_proc", "1", "--dataloader_num_workers", "0", "--save_steps", "1000",
        "--output_dir", str(work / "out"), "--add_version", "false",
        *_device_flags(PER_LAYER_LOGGING if per_layer else None), *extra,
    ]


def _export_flags(checkpoint: Path) -> list[str]:
    return ["--mcore_model", str(checkpoint), "--ddp_backend", "gloo",
            "--megatron_extra_kwargs", '{"persist_layer_norm": false}',
            "--torch_dtype", "float32", "--bf16", "false", "--fp16", "false"]


@pytest.fixture(scope="module")
def runs(tiny_assets, swift_base_env, tmp_path_factory) -> dict[str, Run]:
    tmp = tmp_path_factory.mktemp("megatron_sft")
    base = swift_base_env
    work = {name: tmp / name for name in ("stock", "static", "elastic", "resume", "export",
                                           "mg_forward", "hf", "minimax_m2")}
    elastic_env = {"ELASTIC_MOE_SCHEDULE": SCHEDULE}
    static_env = {"ELASTIC_MOE_SCHEDULE": "static"}
    checkpoint = work["elastic"] / "out" / "checkpoint-4"
    Job = _jobs.Job
    jobs = [
        Job("elastic", _sft(tiny_assets, work["elastic"], "--plugin", extra=("--save_steps", "2"), per_layer=True),
            _env(base, work["elastic"], hook=True, **elastic_env), ROOT),
        Job("stock", _sft(tiny_assets, work["stock"], "none"), _env(base, work["stock"]), ROOT),
        Job("resume", _sft(tiny_assets, work["resume"], "--plugin",
                           extra=("--mcore_model", str(work["elastic"] / "out" / "checkpoint-2"), "--finetune", "false"),
                           per_layer=True),
            _env(base, work["resume"], hook=True, **elastic_env), ROOT, after=("elastic",)),
        Job("static", _sft(tiny_assets, work["static"], "path"), _env(base, work["static"], **static_env), ROOT),
        Job("export", [_megatron(), "export", *_export_flags(checkpoint), "--to_hf", "true",
                       "--output_dir", str(work["export"] / "hf")],
            _env(base, work["export"], **static_env), ROOT, after=("elastic",)),
        Job("mg_forward", [sys.executable, str(HERE / "_megatron_forward.py"), str(work["mg_forward"] / "logits.pt"),
                           *_export_flags(checkpoint), "--output_dir", str(work["mg_forward"] / "unused"),
                           "--exist_ok", "true", "--masked_softmax_fusion", "false"],
            _env(base, work["mg_forward"], nproc=None, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_jobs.free_port()), **static_env),
            ROOT, after=("elastic",)),
    ]
    jobs += [
        Job("hf", [sys.executable, "-I", str(HERE / "_hf_logits.py"), str(work["mg_forward"] / "logits.pt"),
                   str(work["hf"] / "logits.pt"), f"exported={work['export'] / 'hf'}",
                   f"initial={tiny_assets.model_dir(MODEL)}"],
            {k: v for k, v in base.items() if k != "PYTHONPATH"}, work["hf"], after=("export", "mg_forward")),
        # last: it fills the slot the export's chain leaves free
        Job("minimax_m2", _sft(tiny_assets, work["minimax_m2"], "--plugin", model=MINIMAX),
            _env(base, work["minimax_m2"], hook=True, replay=True, ELASTIC_MOE_LAYERS="1", **elastic_env), ROOT),
    ]
    if MCORE_016:
        jobs = [job for job in jobs if job.name in CORE_RUNS]
    results = _jobs.run_jobs(jobs, tmp / "logs")
    for name, result in results.items():
        print(f"megatron sft test run {name}: rc={result.returncode} in {result.seconds:.1f}s")
    return {name: Run(result, work[name]) for name, result in results.items()}


def _ok(runs, name) -> Run:
    run = runs[name]
    assert run.ok, run.result.describe()
    return run


# ================================================================================== the checks
def _z_bound(counts: dict[int, int], schedule) -> list[str]:
    """Every budget's share within Z standard errors of its pmf value; returns the violations.

    With ``sampling=iid`` each token's κ is an independent draw from q, so the share of budget b
    among N tokens has mean q_b and standard error sqrt(q_b (1 - q_b) / N). |share - q_b| <= Z·SE
    holds for one budget with probability >= 1 - 6.3e-5 at Z = 4 (normal approximation; N >= 768
    here, q_b >= 0.27, so N·q_b >= 200 and the approximation is good), so a run of this file's
    histograms (at most 12 budget-layer pairs) fails by chance with probability < 1e-3.
    """
    total = sum(counts.values())
    problems = []
    for budget, q in zip(schedule.budgets, schedule.pmf):
        share = counts.get(budget, 0) / total
        bound = Z * math.sqrt(q * (1 - q) / total)
        if abs(share - q) > bound:
            problems.append(f"κ={budget}: share {share:.4f} vs pmf {q:.4f} (bound ±{bound:.4f}, N={total})")
    return problems


def _histogram(forwards: list[dict], layer: int) -> dict[int, int]:
    counts: dict[int, int] = {}
    for record in forwards:
        if record["layer"] == layer:
            for budget, n in enumerate(record["counts"]):
                if n:
                    counts[budget] = counts.get(budget, 0) + n
    return counts


def test_static_schedule_logs_the_losses_of_stock_megatron_sft_exactly(runs):
    """``ELASTIC_MOE_SCHEDULE=static`` routes stock top-k: loss, grad_norm and the load-balancing
    loss of every step equal the stock run's (as logged: 8 decimals)."""
    stock, static, elastic = _ok(runs, "stock").rows(), _ok(runs, "static").rows(), _ok(runs, "elastic").rows()
    assert [row["iteration"] for row in stock] == [f"{step}/{STEPS}" for step in range(1, STEPS + 1)]
    for label, rows in (("stock", stock), ("static", static)):
        for row in rows:
            print(f"{label:6s} step {row['iteration']}: loss={row['loss']} grad_norm={row['grad_norm']} "
                  f"load_balancing_loss={row['load_balancing_loss']}")
    keys = ("iteration", "loss", "grad_norm", "load_balancing_loss")
    assert [{k: row[k] for k in keys} for row in static] == [{k: row[k] for k in keys} for row in stock]
    assert all(row["grad_norm"] > 0 for row in stock)  # a real norm: clip_grad 1.0 ran on host tensors
    # the comparison can fail: the elastic run (same seed and data) already differs at step 1
    assert elastic[0]["loss"] != static[0]["loss"]


def test_elastic_kappa_follows_the_pmf_per_layer_and_the_log_carries_plan_and_metrics(runs):
    elastic = _ok(runs, "elastic")
    schedule = _schedule()
    output = elastic.output
    assert "elastic-moe: plugin elastic_moe: passing it to ms-swift as --external_plugins" in output  # the hook
    plan = ("elastic-moe plan (megatron-core, 2 MoE layers): elastic 1-3 around k=2 (σ=1.5), renormalized gate, "
            "iid sampling: layers 0-1; static: none")
    assert output.count(plan) == 1, elastic.result.describe()
    forwards = elastic.forwards()
    assert len(forwards) == STEPS * len(LAYERS)  # one micro-batch per step, one forward per layer
    rows = elastic.rows()
    assert len(rows) == STEPS
    for layer in LAYERS:
        counts = _histogram(forwards, layer)
        print(f"elastic layer {layer}: κ histogram {dict(sorted(counts.items()))} over {sum(counts.values())} tokens; "
              f"pmf {dict(zip(schedule.budgets, (round(q, 4) for q in schedule.pmf)))}")
        assert set(counts) <= set(schedule.budgets), counts
        assert not _z_bound(counts, schedule), _z_bound(counts, schedule)
        # Megatron-SWIFT's log carries this step's histogram (as 8-decimal floats)
        per_step = [record for record in forwards if record["layer"] == layer]
        for row, record in zip(rows, per_step):
            tokens = sum(record["counts"])
            for budget in schedule.budgets:
                logged = row[f"elastic_moe/layer_{layer}/kappa_frac_{budget}"]
                assert logged == pytest.approx(record["counts"][budget] / tokens, abs=1e-8), (row["iteration"], budget)
            mean = sum(b * n for b, n in enumerate(record["counts"])) / tokens
            assert row[f"elastic_moe/layer_{layer}/mean_kappa"] == pytest.approx(mean, abs=1e-8)


_REFERENCE_HAVE_TE = """
import importlib, json, sys
from elastic_moe_plugin import cpu_runtime
cpu_runtime.enable()  # the base runtime only (triton stand-in, CUDA runtime): no Megatron-SWIFT scope
found = {}
for name in json.loads(sys.argv[1]):
    found[name] = bool(importlib.import_module(name).HAVE_TE)
print(json.dumps(found))
"""


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU runtime's Transformer Engine stand-in (GPU runs have TE)")
def test_megatron_core_sees_no_transformer_engine_while_mcore_bridge_got_its_stand_ins(runs, swift_base_env):
    """In a training process, every megatron-core module's ``HAVE_TE`` is what the same module says
    when imported without the Megatron-SWIFT scope (a reference process: no mcore-bridge, no TE
    stand-in), ``transformer_engine`` is not importable, and megatron-core's cached TE version, if
    it asked, is 0.0.0; meanwhile mcore-bridge's imports were answered by the stand-ins."""
    import subprocess

    report = _ok(runs, "elastic").te_report()
    assert report["have_te"], "no megatron module with HAVE_TE was loaded?"
    env = {**swift_base_env, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), swift_base_env.get("PYTHONPATH")]))}
    reference = subprocess.run([sys.executable, "-c", _REFERENCE_HAVE_TE, json.dumps(sorted(report["have_te"]))],
                               env=env, capture_output=True, text=True, timeout=300)
    assert reference.returncode == 0, reference.stderr[-3000:]
    expected = json.loads(reference.stdout.strip().splitlines()[-1])
    print(f"HAVE_TE in the training process, {len(report['have_te'])} megatron-core modules: "
          f"{sum(report['have_te'].values())} True (stock without the scope: {sum(expected.values())} True: "
          f"{sorted(k for k, v in expected.items() if v)})")
    assert report["have_te"] == expected
    assert report["transformer_engine_in_sys_modules"] is False
    assert report["megatron_te_version"] in ("None", "<Version('0.0.0')>")  # not asked yet, or asked: absent
    # mcore-bridge did import it (patcher._patch_transformer_engine, tuners/lora.py, ...)
    assert "transformer_engine" in report["served"] and "transformer_engine.pytorch" in report["served"]
    assert "mcore_bridge.model.modules.kernels.qsa_block_sparse_attn" in report["served"]
    assert report["megatron_TEGroupedLinear"] == "None"
    assert report["bridge_TEGroupedLinear"] == "<class 'elastic_moe_plugin.cpu_runtime.megatron_swift.TEGroupedLinear'>"


@needs_full_pass
def test_resume_from_the_step_2_checkpoint_continues_the_uninterrupted_run(runs):
    elastic, resume = _ok(runs, "elastic"), _ok(runs, "resume")
    uninterrupted = {row["iteration"]: row for row in elastic.rows()}
    resumed = resume.rows()
    assert [row["iteration"] for row in resumed] == [f"3/{STEPS}", f"4/{STEPS}"]
    for row in resumed:
        before = uninterrupted[row["iteration"]]
        compared = [k for k in row if k in ("loss", "grad_norm", "load_balancing_loss") or k.startswith("elastic_moe/")]
        print(f"step {row['iteration']}: uninterrupted loss={before['loss']} grad_norm={before['grad_norm']} "
              f"κ_frac(layer 0)={[before[f'elastic_moe/layer_0/kappa_frac_{b}'] for b in (1, 2, 3)]} | resumed "
              f"loss={row['loss']} grad_norm={row['grad_norm']} "
              f"κ_frac(layer 0)={[row[f'elastic_moe/layer_0/kappa_frac_{b}'] for b in (1, 2, 3)]}")
        assert {k: row[k] for k in compared} == {k: before[k] for k in compared}
    # token by token: the last two steps' forwards, both layers
    assert resume.forwards() == elastic.forwards()[-2 * len(LAYERS):]


@needs_full_pass
def test_the_exported_checkpoint_loads_in_plain_transformers_and_matches_megatron(runs):
    """``megatron export --to_hf`` (ms-swift 4.6's converter) of the elastic checkpoint, loaded by
    transformers in a process where ``elastic_moe_plugin`` cannot be imported, gives the logits of
    Megatron's static forward of the same checkpoint.

    Tolerance: both sides compute in float32 (unit roundoff 2^-24 ≈ 6e-8) with different kernels
    and summation orders (PyTorch SDPA vs Megatron's unfused attention, transformers' expert loop
    vs ``SequentialMLP``, fused QKV vs separate projections). For logits of magnitude <= 1 through
    two layers that is some tens of ulps; 1e-5 (about 170 ulps at |logit| = 1) is a bound with room,
    and far below what a conversion error moves: the checkpoint before training (4 Adam steps at
    lr 1e-3 away) must differ by more than 100 times the tolerance, which shows the check can fail.
    """
    import torch

    _ok(runs, "export")
    _ok(runs, "mg_forward")
    hf = _ok(runs, "hf")
    megatron = torch.load(runs["mg_forward"].work / "logits.pt")
    plain = torch.load(hf.work / "logits.pt")
    assert [m for m in plain["plugin_modules"] if m == "elastic_moe_plugin" or m.startswith("elastic_moe_plugin.")] == []
    config = json.loads((runs["export"].work / "hf" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["num_experts_per_tok"] == TOPK
    difference = (plain["exported"] - megatron["logits"]).abs().max().item()
    before_training = (plain["initial"] - megatron["logits"]).abs().max().item()
    print(f"export: max |logits(transformers, exported) - logits(Megatron static forward)| = {difference:.3e} "
          f"(tolerance {EXPORT_ATOL}); the untrained checkpoint differs by {before_training:.3e}; "
          f"logit scale {megatron['logits'].abs().max().item():.3f}")
    assert difference <= EXPORT_ATOL
    assert before_training > 100 * EXPORT_ATOL


@needs_full_pass
def test_minimax_m2_static_layer_routes_stock_and_its_elastic_layer_follows_the_pmf(runs):
    """``megatron sft --plugin elastic_moe`` on MiniMax-M2 (mcore-bridge's model type ``minimax_m2``),
    schedule 1-3 in layer 1 only: mcore-bridge built the router the checkpoint describes (sigmoid
    scores with an expert bias, q/k norms: read from ``config.json``'s ``scoring_func`` and
    ``use_qk_norm``); the plan line names the gate, the elastic layer and the static one; static
    layer 0 returns megatron-core's stock routing of the same logits bit for bit on every step (the
    observer's replay, module docstring), which is what a static schedule does in every layer; layer
    1's κ histogram follows the pmf, and its κ = k tokens keep stock's experts and weights; the
    losses and the load-balancing loss are finite."""
    run = _ok(runs, "minimax_m2")
    output = run.output
    # sigmoid_auto: megatron-core's sigmoid weighing (the kept scores renormalised for κ > 1, the raw score at κ = 1)
    plan = ("elastic-moe plan (megatron-core, 2 MoE layers): elastic 1-3 around k=2 (σ=1.5), sigmoid_auto gate, "
            "iid sampling: layers 1; static top-2: layers 0")
    assert output.count(plan) == 1, run.result.describe()
    forwards = run.forwards()
    assert len(forwards) == STEPS * len(LAYERS)
    # the router mcore-bridge built from config.json: sigmoid scores, an expert bias, q/k norms
    assert {(r["score_function"], r["expert_bias"], r["qk_layernorm"]) for r in forwards} == {("sigmoid", True, True)}
    schedule = _schedule()
    for record in forwards:
        if record["layer"] not in MINIMAX_ELASTIC:
            assert record["stock_equal"], record  # weights and map, bit for bit
            assert record["counts"][TOPK] == sum(record["counts"]), record
    for layer in MINIMAX_ELASTIC:
        at_layer = [record for record in forwards if record["layer"] == layer]
        counts = _histogram(at_layer, layer)
        print(f"minimax_m2 layer {layer}: κ histogram {dict(sorted(counts.items()))} over {sum(counts.values())} "
              f"tokens; pmf {dict(zip(schedule.budgets, (round(q, 4) for q in schedule.pmf)))}")
        assert set(counts) <= set(schedule.budgets) and not _z_bound(counts, schedule), _z_bound(counts, schedule)
        assert not any(record["stock_equal"] for record in at_layer)  # the replay can tell them apart
        for record in at_layer:  # at κ = k, elastic top-κ is stock top-k: same experts, same weights
            assert record["at_k_same_experts"] == record["counts"][TOPK] > 0, record
            assert record["at_k_max_weight_difference"] <= 1e-6, record
    rows = run.rows()
    assert [row["iteration"] for row in rows] == [f"{step}/{STEPS}" for step in range(1, STEPS + 1)]
    for row in rows:
        assert math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"]) and row["grad_norm"] > 0, row
        assert math.isfinite(row["load_balancing_loss"]) and row["load_balancing_loss"] > 0, row

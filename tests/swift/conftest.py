"""Shared fixtures of the ms-swift tests: real ``swift sft`` runs on CPU, offline, with tiny models.

- ``tiny_assets`` (session, built by ``_tiny_assets.py``): a byte-level BPE tokenizer trained here
  with ``tokenizers`` (saved as a ``PreTrainedTokenizerFast`` with a chat template and the special
  tokens swift's ``olmoe``, ``qwen3``, ``deepseek_v4``, ``gpt_oss`` and ``minimax_m2`` templates
  write), tiny random OLMoE (top-2), Qwen3-MoE (top-4), DeepSeek-V4, GPT-OSS and MiniMax-M2 (top-2)
  checkpoints (2 layers, DeepSeek-V4 3, 8 experts, hidden 64) saved with ``save_pretrained``, and a
  local jsonl of ``messages``. Nothing is downloaded.
- ``swift_runs`` (session): the subprocess runs the tests need (:data:`RUNS`: ``swift sft`` runs, the
  ``swift infer`` / ``swift export`` runs on their checkpoints, and the plugin probes of
  ``_plugin_probe.py``), launched together the first time any test asks for one, so their slow
  start-ups (about 20 s of imports each) overlap; a run that reads another's checkpoint starts as
  soon as that one has finished. A test declares the runs it reads with
  ``@pytest.mark.swift_runs("name", ...)``; only the runs of the selected tests (and the runs those
  wait for) are launched. ``swift_runs.result(name)`` waits for one.
- ``no_plugin_venv`` (session): an environment with ms-swift and its frameworks but without
  elastic-moe-plugin, for ``swift infer`` on an elastic checkpoint elsewhere (:func:`no_plugin_venv`);
  ``makefile_venv`` (session): a venv set up like the Makefile's ``.venv``, whose start-up hook the
  Makefile's own ``swift-hook`` step installs (:func:`makefile_venv`).

Every ``swift sft`` from the checkout runs from the repository root and loads the plugin in one of
the accepted forms (:data:`PLUGIN_FORMS`: the documented fallback ``--external_plugins
patches/elastic_moe.py --callbacks elastic_moe``, ``--plugin=elastic_moe``, ``--external_plugins
elastic_moe``, ``plugin: elastic_moe`` in a YAML), the checkout's start-up hook made active by
:func:`with_start_up_hook`; the ``wheel_*`` runs use the installed wheel from a folder outside the
checkout (``wheel_venv``); ``olmoe_zero3`` trains under DeepSpeed ZeRO-3 on 2 ranks
(:func:`_engine_run`). All: full fine-tuning,
``--max_steps 3 --logging_steps 1``, ``--router_aux_loss_coef 0.01``, ``--check_model false``,
``--add_version false`` (a fixed output dir), TensorBoard reporting only where a test reads the
event file (``olmoe_iid``, ``auto_gpt_oss``: at the end of a run ms-swift draws one PNG per logged
scalar, about 0.25 s each, 46 of them for these 2-layer models), one torch thread
(``OMP_NUM_THREADS=1``: a 2-core runner stalls a thread pool on these tiny tensors), no GPU
(``CUDA_VISIBLE_DEVICES=""``) and ``HF_HUB_OFFLINE=1`` / ``HF_DATASETS_OFFLINE=1`` /
``TRANSFORMERS_OFFLINE=1`` with private caches. Without ms-swift installed, every test module in
this folder is skipped at collection.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

HAVE_SWIFT = importlib.util.find_spec("swift") is not None and importlib.util.find_spec("transformers") is not None

if not HAVE_SWIFT:
    collect_ignore_glob = ["test_*.py"]

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = "patches/elastic_moe.py"  # relative to ROOT, exactly as documented
PROBE = Path(__file__).with_name("_plugin_probe.py")

# --------------------------------------------------------------------------- tiny assets
def _load_helper(name: str):
    """A helper module of this folder, by path (whatever pytest's import mode)."""
    spec = importlib.util.spec_from_file_location(f"_elastic_moe_tests_swift_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


_assets = _load_helper("_tiny_assets")
TinyAssets, MODELS, BATCH_SIZE = _assets.TinyAssets, _assets.MODELS, _assets.BATCH_SIZE
engine_probe = _load_helper("_engine_probe")


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory) -> TinyAssets:
    return _assets.build(tmp_path_factory.mktemp("swift_tiny"))


@pytest.fixture(scope="session")
def swift_base_env(tmp_path_factory) -> dict[str, str]:
    """:func:`base_env` with private caches, for tests that start their own subprocesses."""
    return base_env(tmp_path_factory.mktemp("swift_cache"))


# --------------------------------------------------------------------------- runs
def swift_command() -> list[str]:
    """The ``swift`` console script of this interpreter's environment."""
    script = Path(sys.executable).with_name("swift")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from swift.cli.main import cli_main; sys.argv[0] = 'swift'; cli_main()"]


#: how a run loads the plugin: the documented fallback (a path, relative to the checkout) or a name
PLUGIN_FORMS = {
    "path": ["--external_plugins", PLUGIN, "--callbacks", "elastic_moe"],
    "--plugin": ["--plugin", "elastic_moe"],
    "--plugin=": ["--plugin=elastic_moe"],
    "name as path": ["--external_plugins", "elastic_moe"],
    "unknown name": ["--plugin", "nosuch"],
}


def sft_flags(assets: TinyAssets, model: str, output_dir: Path, plugin: str = "path", steps: int = 3,
              save: bool = False, tensorboard: bool = False) -> list[str]:
    """The ``swift sft`` flags after ``sft`` (one run: ``steps`` steps of one micro-batch of 8 rows;
    ``save``: one model-only checkpoint, ``output_dir/checkpoint-<steps>``; ``tensorboard``: report to
    TensorBoard, else to nothing but ``logging.jsonl``, which every test reads)."""
    model_type, template = MODELS[model][:2]
    saving = (["--save_strategy", "steps", "--save_steps", str(steps), "--save_only_model", "true"] if save
              else ["--save_strategy", "no"])
    return [
        "--model", str(assets.model_dir(model)), "--model_type", model_type, "--template", template,
        "--dataset", str(assets.dataset), "--check_model", "false",
        *PLUGIN_FORMS[plugin],
        "--tuner_type", "full", "--max_steps", str(steps), "--logging_steps", "1", "--router_aux_loss_coef", "0.01",
        "--per_device_train_batch_size", str(BATCH_SIZE), "--gradient_accumulation_steps", "1",
        "--max_length", "512", *saving, "--report_to", "tensorboard" if tensorboard else "none",
        "--dataloader_num_workers", "0", "--dataset_num_proc", "1",
        "--output_dir", str(output_dir), "--add_version", "false",
    ]


def yaml_config(assets: TinyAssets, model: str, output_dir: Path, env: dict[str, str], plugin: str = "path") -> str:
    """A swift YAML config equivalent to :func:`sft_flags`, with an ``ENV:`` block (typed values);
    ``plugin="--plugin"`` writes ``plugin: elastic_moe``."""
    import yaml

    flags = sft_flags(assets, model, output_dir, plugin)
    config: dict[str, Any] = {"ENV": dict(env)}
    for key, value in zip(flags[::2], flags[1::2]):
        config[key.removeprefix("--")] = _yaml_value(key, value)
    return yaml.safe_dump(config, sort_keys=False)


def _yaml_value(flag: str, value: str) -> Any:
    if flag in ("--external_plugins", "--callbacks"):
        return [value]
    if flag == "--plugin":
        return value
    if value in ("true", "false"):
        return value == "true"
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def base_env(cache: Path) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items()
           if not key.startswith("ELASTIC_MOE_") and key not in ("NPROC_PER_NODE", "NNODES", "SWIFT_CONFIG_FILE")}
    env.update(
        HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_CACHE=str(cache / "hf_datasets"), MODELSCOPE_CACHE=str(cache / "modelscope"),
        OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", TORCH_COMPILE_DISABLE="1",
        CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1",
    )
    return env


@dataclasses.dataclass
class RunSpec:
    argv: list[str]
    env: dict[str, str]
    output_dir: Path | None = None
    result_file: Path | None = None
    timeout: float = 420.0
    cwd: Path = ROOT


@dataclasses.dataclass
class RunResult:
    name: str
    argv: list[str]
    returncode: int
    output: str  # stdout and stderr, interleaved
    seconds: float
    output_dir: Path | None
    result_file: Path | None
    env: dict[str, str]

    @property
    def command(self) -> str:
        return shlex.join(self.argv)

    def logging_rows(self) -> list[dict[str, Any]]:
        """The run's ``logging.jsonl`` (swift's log), one dict per line; [] if absent."""
        path = self.output_dir / "logging.jsonl" if self.output_dir else None
        if path is None or not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def training_rows(self) -> list[dict[str, Any]]:
        """Rows logged at a training step (with a loss), not eval or the end-of-run summary."""
        return [row for row in self.logging_rows() if "loss" in row and "train_runtime" not in row]

    def probe(self) -> dict[str, Any]:
        return json.loads(self.result_file.read_text())

    def describe(self) -> str:
        return f"{self.name}: rc={self.returncode} after {self.seconds:.0f}s\n$ {self.command}\n{self.output[-6000:]}"


def with_start_up_hook(env: dict[str, str], work: Path) -> dict[str, str]:
    """``env`` for a process tree in which the checkout's start-up hook acts as the wheel installs
    it: a ``sitecustomize`` on ``PYTHONPATH`` hands a folder holding a copy of ``elastic-moe-swift.pth``
    to ``site.addsitedir``, which executes its line the way it executes site-packages' ``.pth``
    files (an editable install of the checkout ships no ``.pth``)."""
    hook_dir, site_dir = work / "hook", work / "hook" / "site"
    site_dir.mkdir(parents=True)
    (site_dir / "elastic-moe-swift.pth").write_bytes((ROOT / "elastic-moe-swift.pth").read_bytes())
    (hook_dir / "sitecustomize.py").write_text(f"import site\nsite.addsitedir({str(site_dir)!r})\n")
    path = [str(hook_dir)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    return {**env, "PYTHONPATH": os.pathsep.join(path)}


#: steps of the runs whose checkpoint infer/export read (checkpoint-<steps>)
AUTO_STEPS = 2
#: runs alive at once: each ms-swift process holds about 1 GB and spends most of its time importing,
#: so a few share the CPUs well, while all of them at once would crowd memory and push runs past
#: their timeouts (which count from their own start)
MAX_PARALLEL = 4


#: run name -> how to build it (assets, work dir, env, and the fixtures or runs it ``needs``) -> RunSpec
def _sft_run(model: str, env: dict[str, str], plugin: str = "path", tensorboard: bool = False):
    def build(assets: TinyAssets, work: Path, base: dict[str, str]) -> RunSpec:
        output_dir = work / "out"
        run_env = {**base, **env}
        if plugin != "path":
            run_env = with_start_up_hook(run_env, work)
        flags = sft_flags(assets, model, output_dir, plugin, tensorboard=tensorboard)
        return RunSpec([*swift_command(), "sft", *flags], run_env, output_dir)

    return build


def _yaml_run(model: str, env: dict[str, str], plugin: str = "path"):
    def build(assets: TinyAssets, work: Path, base: dict[str, str]) -> RunSpec:
        output_dir = work / "out"
        config = work / "sft.yaml"
        config.write_text(yaml_config(assets, model, output_dir, env, plugin))
        run_env = dict(base) if plugin == "path" else with_start_up_hook(dict(base), work)
        return RunSpec([*swift_command(), "sft", str(config)], run_env, output_dir)

    return build


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wheel_run(model: str, env: dict[str, str], plugin: str = "--plugin", *, yaml_env: dict[str, str] | None = None,
               steps: int = 3, nproc: int | None = None):
    """``swift sft`` from the installed wheel (``wheel_venv``), run from a folder outside the checkout."""
    def build(assets: TinyAssets, work: Path, base: dict[str, str], wheel_venv: dict) -> RunSpec:
        wheel = wheel_venv
        output_dir = work / "out"
        run_env = {k: v for k, v in base.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        run_env.update(env, PATH=f"{wheel['bin']}{os.pathsep}{base.get('PATH', '')}")
        if nproc is not None:
            run_env.update(NPROC_PER_NODE=str(nproc), MASTER_PORT=str(_free_port()))
        swift = str(wheel["bin"] / "swift")
        if yaml_env is not None:
            config = work / "sft.yaml"
            config.write_text(yaml_config(assets, model, output_dir, yaml_env, plugin))
            argv = [swift, "sft", str(config)]
        else:
            argv = [swift, "sft", *sft_flags(assets, model, output_dir, plugin, steps)]
            if nproc is not None:
                argv += ["--ddp_backend", "gloo"]
        return RunSpec(argv, run_env, output_dir, cwd=wheel["cwd"])

    build.needs = ("wheel_venv",)
    return build


def _engine_run(model: str, engine: str, env: dict[str, str]):
    """``swift sft --plugin elastic_moe --deepspeed ENGINE`` from the checkout on 2 CPU ranks, launched as
    docs/swift.md ("Engines: DeepSpeed and FSDP2") says for a CPU host: ``--use_cpu true --fp16 false
    --ddp_backend gloo``, the child bootstrap's ``engines`` in every process. Every rank records the
    DeepSpeed engine it builds in ``work/engine/rank<R>.json`` (``_engine_probe.py``, run by a ``.pth``
    next to the start-up hook's)."""
    def build(assets: TinyAssets, work: Path, base: dict[str, str]) -> RunSpec:
        from elastic_moe_plugin.tools import child_bootstrap

        output_dir = work / "out"
        run_env = {**base, **env, "NPROC_PER_NODE": "2", "MASTER_PORT": str(_free_port()),
                   engine_probe.PROBE_ENV: str(work / "engine")}
        run_env = with_start_up_hook(run_env, work)
        (work / "hook" / "site" / "engine-probe.pth").write_text(engine_probe.START_UP_LINE + "\n")
        run_env.update(child_bootstrap.environment(["engines"], run_env["PYTHONPATH"]))
        flags = [*sft_flags(assets, model, output_dir, "--plugin"), "--deepspeed", engine, "--ddp_backend", "gloo",
                 "--use_cpu", "true", "--fp16", "false"]
        return RunSpec([*swift_command(), "sft", *flags], run_env, output_dir)

    return build


def _auto_run(model: str, tensorboard: bool = False):
    """``swift sft ... --plugin elastic_moe`` from the checkout with no ``ELASTIC_MOE_*`` variable at all:
    the schedule comes from the model; 2 steps, one model-only checkpoint."""
    def build(assets: TinyAssets, work: Path, base: dict[str, str]) -> RunSpec:
        output_dir = work / "out"
        flags = sft_flags(assets, model, output_dir, "--plugin", steps=AUTO_STEPS, save=True, tensorboard=tensorboard)
        return RunSpec([*swift_command(), "sft", *flags], with_start_up_hook(dict(base), work), output_dir)

    return build


def _makefile_venv_run(model: str):
    """The same, typed in the venv the Makefile sets up (``makefile_venv``: its ``swift-hook`` step put
    the start-up hook there), from the checkout."""
    def build(assets: TinyAssets, work: Path, base: dict[str, str], makefile_venv: dict) -> RunSpec:
        output_dir = work / "out"
        flags = sft_flags(assets, model, output_dir, "--plugin", steps=AUTO_STEPS, save=True)
        env = {**base, "PATH": f"{makefile_venv['bin']}{os.pathsep}{base.get('PATH', '')}"}
        env.pop("VIRTUAL_ENV", None)
        return RunSpec([str(makefile_venv["bin"] / "swift"), "sft", *flags], env, output_dir)

    build.needs = ("makefile_venv",)
    return build


def checkpoint_of(result: RunResult) -> Path:
    return result.output_dir / f"checkpoint-{AUTO_STEPS}"


def _checkpoint_run(trained: str, command: str, *, plugin: bool = False, environment: str = "plugin"):
    """``swift infer`` / ``swift export`` on the checkpoint of run ``trained``, with no ``ELASTIC_MOE_*``
    variable: in the test venv (the plugin installed, its start-up hook active; ``plugin``: with
    ``--plugin elastic_moe`` typed as well), or in ``no_plugin_venv`` from a folder outside the checkout."""
    def build(assets: TinyAssets, work: Path, base: dict[str, str], results: dict, **venvs) -> RunSpec:
        checkpoint = checkpoint_of(results[trained])
        if command == "infer":
            flags = ["--model", str(checkpoint), "--val_dataset", f"{assets.dataset}#2", "--max_new_tokens", "4",
                     "--infer_backend", "transformers", "--result_path", str(work / "infer.jsonl")]
        else:
            flags = ["--model", str(checkpoint), "--to_ollama", "true", "--output_dir", str(work / "ollama")]
        flags += ["--plugin", "elastic_moe"] if plugin else []
        if environment == "no_plugin":
            venv = venvs["no_plugin_venv"]
            env = {k: v for k, v in base.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
            env["PATH"] = f"{venv['bin']}{os.pathsep}{base.get('PATH', '')}"
            return RunSpec([str(venv["bin"] / "swift"), command, *flags], env, result_file=work / "infer.jsonl",
                           cwd=venv["cwd"])
        env = with_start_up_hook(dict(base), work)
        return RunSpec([*swift_command(), command, *flags], env, result_file=work / (
            "infer.jsonl" if command == "infer" else "ollama/Modelfile"))

    build.after = (trained,)
    build.needs = ("no_plugin_venv",) if environment == "no_plugin" else ()
    return build


def _probe_run(mode: str):
    def build(assets: TinyAssets | None, work: Path, base: dict[str, str]) -> RunSpec:
        result_file = work / "probe.json"
        return RunSpec([sys.executable, str(PROBE), mode, str(result_file)], dict(base), result_file=result_file,
                       timeout=300.0)

    return build


RUNS = {
    # transformers path, both models; the schedules are centred on each model's top-k
    "olmoe_iid": _sft_run("olmoe", {"ELASTIC_MOE_SCHEDULE": "1-3"}, tensorboard=True),  # the documented fallback: a path
    # the schedule and the sampling come only from the YAML's ENV: block; the plugin's name where
    # ms-swift wants a path
    "qwen3_moe_yaml_balanced": _yaml_run("qwen3_moe", {"ELASTIC_MOE_SCHEDULE": "2-6",
                                                       "ELASTIC_MOE_SAMPLING": "balanced"}, plugin="name as path"),
    "bad_schedule": _sft_run("olmoe", {"ELASTIC_MOE_SCHEDULE": "11-5"}),
    # from the installed wheel, outside the checkout (test_swift_wheel.py)
    "wheel_yaml": _wheel_run("qwen3_moe", {}, yaml_env={"ELASTIC_MOE_SCHEDULE": "2-6"}),
    "wheel_unknown_plugin": _wheel_run("olmoe", {"ELASTIC_MOE_SCHEDULE": "1-3"}, plugin="unknown name"),
    "wheel_off_switch": _wheel_run("olmoe", {"ELASTIC_MOE_SCHEDULE": "1-3", "ELASTIC_MOE_SWIFT_HOOK": "0"}),
    "wheel_two_ranks": _wheel_run("olmoe", {"ELASTIC_MOE_SCHEDULE": "1-3"}, nproc=2),
    # DeepSpeed ZeRO-3 (zero.Init) on 2 CPU ranks under the CPU runtime's engines part (test_swift_engines.py)
    "olmoe_zero3": _engine_run("olmoe", "zero3", {"ELASTIC_MOE_SCHEDULE": "1-3"}),
    # the plugin file in a `swift sft`-like and a `megatron sft`-like process
    "probe_hf": _probe_run("hf"),
    "probe_megatron": _probe_run("megatron"),
    # no ELASTIC_MOE_* at all: the schedule is resolved from each model's top-k (test_swift_lifecycle.py)
    "auto_top2": _auto_run("olmoe"),
    "auto_top8": _makefile_venv_run("qwen3_moe_top8"),  # typed in the Makefile's venv
    "dense_refused": _auto_run("qwen3_dense"),
    # the transformers door's other routing styles, no settings either (test_swift_sft.py), top-2:
    # DeepSeek-V4 (activation + correction bias, a hash-routed layer), GPT-OSS (top-k on the logits,
    # at mlp.router) and MiniMax-M2 (sigmoid + a correction bias its block passes in)
    "auto_deepseek_v4": _auto_run("deepseek_v4"),
    "auto_gpt_oss": _auto_run("gpt_oss", tensorboard=True),
    "auto_minimax_m2": _auto_run("minimax_m2"),
    # inference and export on those checkpoints need no training schedule, and no plugin
    "infer_top8": _checkpoint_run("auto_top8", "infer", plugin=True),
    "export_top8": _checkpoint_run("auto_top8", "export", plugin=True),
    "no_plugin_infer_top2": _checkpoint_run("auto_top2", "infer", environment="no_plugin"),
    "infer_deepseek_v4": _checkpoint_run("auto_deepseek_v4", "infer"),
    "infer_minimax_m2": _checkpoint_run("auto_minimax_m2", "infer"),
}
_NEEDS_ASSETS = {name for name in RUNS if not name.startswith("probe_")}


class SwiftRuns:
    """Launches the selected runs together (on first use) and hands out their results."""

    def __init__(self, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
        self._request = request
        self._tmp = tmp_path_factory
        self._running: dict[str, tuple[subprocess.Popen, RunSpec, float, Path]] = {}
        self._results: dict[str, RunResult] = {}
        self._pending: list[str] = []  # waiting for the runs they read
        self._queued: list[str] = []  # ready, waiting for a slot
        self._assets: TinyAssets | None = None
        self._base: dict[str, str] | None = None

    def _wanted(self) -> list[str]:
        names: list[str] = []
        for item in self._request.session.items:
            if _skipped(item):
                continue
            for marker in item.iter_markers("swift_runs"):
                names += [name for name in marker.args if name not in names]
        return _with_dependencies(names)

    def _launch(self, names: list[str]) -> None:
        names = [name for name in names if name not in self._running and name not in self._results
                 and name not in self._pending and name not in self._queued]
        if not names:
            return
        if self._assets is None and _NEEDS_ASSETS & set(names):
            self._assets = self._request.getfixturevalue("tiny_assets")
        if self._base is None:
            self._base = base_env(self._tmp.mktemp("swift_cache"))
        for name in names:
            build = RUNS[name]
            if any(dependency not in self._results for dependency in getattr(build, "after", ())):
                self._pending.append(name)  # started once the runs it reads have finished
                continue
            self._start(name)

    def _start(self, name: str) -> None:
        if len(self._running) >= MAX_PARALLEL:
            self._queued.append(name)  # started when a slot frees (see result())
            return
        build = RUNS[name]
        work = self._tmp.mktemp(name)
        extras = {fixture: self._request.getfixturevalue(fixture) for fixture in getattr(build, "needs", ())}
        if getattr(build, "after", ()):
            extras["results"] = {dependency: self._results[dependency] for dependency in build.after}
        spec = build(self._assets, work, self._base, **extras)
        log = work / "output.log"
        with log.open("wb") as sink:
            process = subprocess.Popen(spec.argv, cwd=spec.cwd, env=spec.env, stdout=sink, stderr=subprocess.STDOUT)
        self._running[name] = (process, spec, time.monotonic(), log)

    def _start_ready(self) -> None:
        for name in list(self._queued):
            if len(self._running) >= MAX_PARALLEL:
                return
            self._queued.remove(name)
            self._start(name)
        for name in list(self._pending):
            if all(dependency in self._results for dependency in RUNS[name].after):
                self._pending.remove(name)
                self._start(name)

    def result(self, name: str) -> RunResult:
        if name in self._results:
            return self._results[name]
        if name not in self._running:
            self._launch(list(dict.fromkeys([*self._wanted(), *_with_dependencies([name])])))
        while name not in self._results:
            # collect every run that has ended (or run out of time), so that its slot is refilled at
            # once, not when the run waited for here ends
            if not self._collect_ended():
                time.sleep(0.2)
        return self._results[name]

    def _collect_ended(self) -> bool:
        """Collect the runs that have ended or timed out (each collection starts what is ready);
        True if there was one."""
        ended = [other for other, (process, spec, started, _) in self._running.items()
                 if process.poll() is not None or time.monotonic() - started > spec.timeout]
        for other in ended:
            self._collect(other)
        return bool(ended)

    def _collect(self, name: str) -> RunResult:
        process, spec, started, log = self._running.pop(name)
        try:
            returncode = process.wait(timeout=max(1.0, spec.timeout - (time.monotonic() - started)))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            returncode = -9
        result = RunResult(name=name, argv=spec.argv, returncode=returncode,
                           output=log.read_text(errors="replace"), seconds=time.monotonic() - started,
                           output_dir=spec.output_dir, result_file=spec.result_file, env=spec.env)
        self._results[name] = result
        self._start_ready()
        return result

    def close(self) -> None:
        for process, *_ in self._running.values():
            if process.poll() is None:
                process.kill()
                process.wait()
        self._running.clear()


def _with_dependencies(names: list[str]) -> list[str]:
    """``names`` and every run they read the output of, dependencies first."""
    ordered: list[str] = []

    def add(name: str) -> None:
        for dependency in getattr(RUNS[name], "after", ()):
            add(dependency)
        if name not in ordered:
            ordered.append(name)

    for name in names:
        add(name)
    return ordered


def _skipped(item: pytest.Item) -> bool:
    """A test that will be skipped (``skip``, or ``skipif`` with a true condition) needs no run."""
    if any(True for _ in item.iter_markers("skip")):
        return True
    return any(marker.args and marker.args[0] is True for marker in item.iter_markers("skipif"))


@pytest.fixture(scope="session")
def swift_runs(request, tmp_path_factory):
    runs = SwiftRuns(request, tmp_path_factory)
    yield runs
    runs.close()


def pytest_configure(config):
    config.addinivalue_line("markers", "swift_runs(*names): the tests/swift subprocess runs this test reads")


def pytest_collection_modifyitems(config, items):
    for item in items:
        for marker in item.iter_markers("swift_runs"):
            unknown = [name for name in marker.args if name not in RUNS]
            if unknown:
                raise pytest.UsageError(f"{item.nodeid}: unknown swift run(s) {unknown}; known: {sorted(RUNS)}")



# --------------------------------------------------------------------------- other environments
def _venv_with_swift(root: Path, site_lines: list[str]) -> dict:
    """A fresh venv (no pip) whose site-packages holds one ``.pth`` of ``site_lines`` and ms-swift's
    console scripts (``swift``, ``megatron``) written for its own interpreter, as pip writes them.
    Returns {'python', 'bin', 'site'}."""
    import importlib.metadata
    import venv

    venv.EnvBuilder(with_pip=False).create(root)
    python = root / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "_test_venv_packages.pth").write_text("".join(line + "\n" for line in site_lines))
    for entry in importlib.metadata.distribution("ms-swift").entry_points:
        if entry.group == "console_scripts":
            script = root / "bin" / entry.name
            script.write_text(f"#!{python}\nimport sys\nfrom {entry.module} import {entry.attr}\n"
                              f"if __name__ == '__main__':\n    sys.exit({entry.attr}())\n")
            script.chmod(0o755)
    return {"python": str(python), "bin": root / "bin", "site": site}


def _test_venv_purelib() -> str:
    import sysconfig

    return sysconfig.get_paths()["purelib"]


@pytest.fixture(scope="session")
def no_plugin_venv(tmp_path_factory) -> dict:
    """{'python', 'bin', 'site', 'cwd'}: ms-swift, transformers and torch, and no elastic-moe-plugin.

    A fresh venv sees the test venv's site-packages as a plain path entry: its packages import, but
    none of its ``.pth`` files runs, so neither the editable install of the checkout (a ``.pth`` and
    a finder) nor an ``elastic-moe-swift.pth`` start-up hook exists there; the runs clear
    ``PYTHONPATH`` and start in a folder outside the checkout. That is an environment where ms-swift
    is installed and elastic-moe-plugin is not, without a second copy of several GB of packages; the
    fixture proves it by importing both.
    """
    work = tmp_path_factory.mktemp("no_plugin")
    environment = _venv_with_swift(work / "venv", [_test_venv_purelib()])
    outside = work / "elsewhere"
    outside.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    probe = subprocess.run([environment["python"], "-c", "import swift, transformers\ntry:\n import elastic_moe_plugin\n"
                            "except ModuleNotFoundError as error:\n print('missing', error.name)"],
                           capture_output=True, text=True, cwd=outside, env=env)
    assert probe.returncode == 0 and probe.stdout.strip() == "missing elastic_moe_plugin", probe.stdout + probe.stderr
    return {**environment, "cwd": outside}


@pytest.fixture(scope="session")
def makefile_venv(tmp_path_factory) -> dict:
    """{'python', 'bin', 'site'}: a venv set up as ``make setup`` sets up ``.venv``, the start-up hook
    installed by the Makefile's own ``swift-hook`` step (``make swift-hook VENV=...``).

    The test venv cannot be modified (it is shared), so a fresh venv stands in for it: its
    site-packages sees the test venv's packages as a path entry and runs the test venv's editable-install
    line (``__editable__.*.pth``: the checkout importable as ``make setup``'s ``pip install -e`` makes
    it), and nothing else, so the only start-up hook it can have is the one ``make swift-hook`` puts there.
    """
    import shutil

    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    purelib = Path(_test_venv_purelib())
    editable = [line for pth in sorted(purelib.glob("__editable__*elastic_moe_plugin*.pth"))
                for line in pth.read_text().splitlines() if line.strip()]
    environment = _venv_with_swift(tmp_path_factory.mktemp("makefile") / "venv", [str(purelib), *editable])
    hook = environment["site"] / "elastic-moe-swift.pth"
    assert not hook.exists()
    step = subprocess.run(["make", "-s", "-C", str(ROOT), "swift-hook", f"VENV={environment['bin'].parent}"],
                          capture_output=True, text=True)
    assert step.returncode == 0, step.stdout + step.stderr
    assert hook.read_bytes() == (ROOT / "elastic-moe-swift.pth").read_bytes()
    return environment

"""Run a Megatron-LM training script with Elastic Expert Routing applied, on GPUs or (``--cpu``) on the CPU.

::

    python -m elastic_moe_plugin.megatron_lm PATH/TO/pretrain_gpt.py <megatron args> \\
        --elastic-moe-schedule 6-10 [--elastic-moe-layers 3-7 ...]

    torchrun --nnodes 2 --nproc-per-node 8 ... -m elastic_moe_plugin.megatron_lm \\
        PATH/TO/pretrain_gpt.py <megatron args> --elastic-moe-schedule 6-10

    # a CPU-only machine: Megatron-LM's own trainer on gloo ranks (docs/megatron.md, "Megatron-LM on the CPU")
    torchrun --nproc-per-node 2 -m elastic_moe_plugin.megatron_lm --cpu PATH/TO/pretrain_gpt.py \\
        <megatron args> --distributed-backend gloo --transformer-impl local ... --elastic-moe-schedule 1-3

Every rank runs this module. It

1. takes its own options out of the command line before Megatron parses its arguments, so Megatron
   never sees them: ``--cpu`` (before the script path) and the ``--elastic-moe-*`` flags (anywhere);
   a misspelt ``--elastic-moe-...`` flag is an error here rather than an "unrecognized arguments"
   there;
2. builds the :class:`~elastic_moe_plugin.core.config.ElasticConfig` from defaults < YAML
   (``--elastic-moe-config`` / ``ELASTIC_MOE_CONFIG``) < ``ELASTIC_MOE_*`` < the flags, checked against
   the model Megatron's flags describe (``--moe-router-topk``, ``--num-experts``, ``--num-layers`` or
   ``--hybrid-layer-pattern``), and refuses every other option those flags already decide (a CUDA
   graph that captures the router, sinkhorn or quantile balancing, ...:
   :mod:`elastic_moe_plugin.mcore.megatron_args`), all before Megatron initialises anything, with or
   without ``--cpu``;
3. with ``--cpu``, switches the opt-in CPU runtime on before anything imports megatron
   (:func:`enable_cpu_runtime`): ``elastic_moe_plugin.cpu_runtime.enable(training=True)`` (the CUDA
   runtime calls of megatron-core and of Megatron-LM's training loop answered on the CPU, the
   triton-only module megatron-core imports, a sequence-parallel torch norm), the Python 3.11 shims
   of ``megatron.training`` where needed (``cpu_runtime.megatron_training``), and torch.compile off
   unless ``TORCH_COMPILE_DISABLE`` is set. It refuses when CUDA is available. A hybrid model
   (``--hybrid-layer-pattern``) without ``--spec`` gets the CPU runtime's local stack spec,
   ``--spec elastic_moe_plugin.cpu_runtime.hybrid hybrid_stack_spec`` (:func:`cpu_megatron_args`; Megatron's
   default hybrid spec is Transformer Engine's); a ``--spec`` of the user's is left alone;
4. runs the script in this process (:func:`elastic_moe_plugin.mcore.megatron_lm.run`): the script's
   folder first on ``sys.path``, :func:`elastic_moe_plugin.mcore.apply`, the routing metrics in
   Megatron-LM's log as ``--elastic-moe-log-metrics`` says (``ElasticConfig.log_metrics``, also
   ``ELASTIC_MOE_LOG_METRICS``): ``layers`` (the default) the layer means and, with
   ``--moe-per-layer-logging``, every layer's values; ``means`` the layer means only; ``off`` none,
   and no hook (``true`` / ``false``, this option's old values, read as ``layers`` / ``off``); then the
   script as ``__main__``.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import shlex
import sys
from collections.abc import Sequence
from typing import NoReturn

from elastic_moe_plugin.core.config import ConfigError, ElasticConfig, add_cli_arguments, config_from_cli
from elastic_moe_plugin.core.errors import UnsupportedMegatronError
from elastic_moe_plugin.mcore import megatron_args as megatron_args_module
from elastic_moe_plugin.mcore import megatron_lm as mcore_megatron_lm

PROG = "elastic_moe_plugin.megatron_lm"
FLAG_PREFIX = "--elastic-moe-"
#: an option of this entry point: run Megatron-LM on the CPU (the opt-in CPU runtime)
CPU_FLAG = "--cpu"
USAGE = (
    f"python -m {PROG} [{CPU_FLAG}] PATH/TO/pretrain_gpt.py [megatron args] "
    "[--elastic-moe-schedule 6-10] [--elastic-moe-layers 3-7] [--elastic-moe-<field> VALUE ...] "
    "[--elastic-moe-log-metrics layers|means|off]"
)
CPU_HELP = (
    f"{CPU_FLAG} (before the script path): run Megatron-LM on a CPU-only machine through the opt-in "
    "CPU runtime (elastic_moe_plugin.cpu_runtime); refused when CUDA is available. Megatron-LM then needs "
    "--distributed-backend gloo --transformer-impl local --no-gradient-accumulation-fusion "
    "--no-persist-layer-norm --clip-grad 0, --disable-bias-linear for MoE at TP = EP = 1, and with TP > 1 "
    "CUDA_DEVICE_MAX_CONNECTIONS=1 and --sequence-parallel (docs/megatron.md, 'Megatron-LM on the CPU'). With "
    "--hybrid-layer-pattern and no --spec, --spec elastic_moe_plugin.cpu_runtime.hybrid hybrid_stack_spec is "
    "added (local attention, MLP and MoE layers; no Mamba without mamba_ssm)."
)
SPEC_FLAG = "--spec"
#: Megatron-LM's ``--spec MODULE NAME`` (nargs="*") for the CPU runtime's local hybrid stack spec
CPU_HYBRID_SPEC = (SPEC_FLAG, "elastic_moe_plugin.cpu_runtime.hybrid", "hybrid_stack_spec")


@dataclasses.dataclass(frozen=True)
class Launch:
    """What the command line asks for: the routing config (``config.log_metrics``: what of the routing
    metrics goes to Megatron-LM's log), the script, Megatron's own arguments, and whether Megatron
    runs on the CPU."""

    config: ElasticConfig
    script: str
    megatron_args: list[str]
    cpu: bool = False


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are :class:`ConfigError` (one message format, exit status 2 in :func:`main`)."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{message}. Usage: {USAGE}")


def parse_argv(argv: Sequence[str], environ=None) -> Launch:
    """``argv`` (without the program name) -> :class:`Launch`.

    Raises:
        ConfigError: no script given, an unknown ``--elastic-moe-*`` flag, an invalid value, or
            ``--cpu`` after the script path.
    """
    argv = list(argv)
    parser = _Parser(prog=PROG, add_help=False, allow_abbrev=False)
    parser.add_argument(CPU_FLAG, dest="cpu", action="store_true")
    add_cli_arguments(parser, prefix=FLAG_PREFIX)
    known, rest = parser.parse_known_args(argv)
    flags = [a.split("=", 1)[0] for a in parser._option_string_actions if a != CPU_FLAG]
    stray = [a for a in rest if a.startswith(FLAG_PREFIX)]
    if stray:
        raise _unknown_flags(stray, rest, flags)
    if not rest or rest[0].startswith("-"):
        raise ConfigError(f"no training script given. Usage: {USAGE}")
    script, megatron_args = rest[0], rest[1:]
    if not script.endswith(".py"):
        raise ConfigError(f"{script!r} is not a Python script. Usage: {USAGE}")
    if CPU_FLAG in argv[argv.index(script) + 1 :]:
        raise ConfigError(
            f"{CPU_FLAG} is an option of {PROG}, not of Megatron-LM: put it before the script path, "
            f"python -m {PROG} {CPU_FLAG} {script} [megatron args]"
        )
    # the model the flags decide: the config's own checks, and every fix it suggests, are against it
    model = megatron_args_module.model_shape(megatron_args)
    return Launch(config_from_cli(known, environ, model=model), script, megatron_args, known.cpu)


def _unknown_flags(stray: list[str], rest: list[str], flags: list[str]) -> ConfigError:
    """An unknown ``--elastic-moe-*`` flag: the closest known one and, for a field, the fix renamed."""
    hints, fixes, renames = [], [], {}
    for arg in stray:
        value: str | None
        name, sep, value = arg.partition("=")
        if not sep:
            after = rest.index(arg) + 1
            value = rest[after] if after < len(rest) and not rest[after].startswith("-") else None
        close = difflib.get_close_matches(name, flags, n=1)
        field = close[0][len(FLAG_PREFIX) :].replace("-", "_") if close else None
        if close and value is not None and field in ElasticConfig.field_names():
            renames[name] = close[0]
            fixes.append({field: value})
            hints.append(f"{name} (did you mean {close[0]}? {close[0]} {shlex.quote(value)})")
        else:
            hints.append(name + (f" (did you mean {close[0]}?)" if close else ""))
    return ConfigError(
        f"unknown elastic-moe flag(s): {', '.join(hints)}. Accepted: {', '.join(sorted(flags))}.",
        fixes=tuple(fixes),
        renames=renames,
    )


def split_argv(argv: Sequence[str], environ=None) -> tuple[ElasticConfig, str, list[str]]:
    """``argv`` (without the program name) -> (config, script path, Megatron's own arguments).

    Raises:
        ConfigError: as :func:`parse_argv`.
    """
    launch = parse_argv(argv, environ)
    return launch.config, launch.script, launch.megatron_args


def enable_cpu_runtime() -> None:
    """What ``--cpu`` switches on, before anything imports megatron (step 3 of the module docstring).

    Raises:
        elastic_moe_plugin.cpu_runtime.MegatronCPUError: CUDA is available. The message names both
            fixes: drop ``--cpu`` to train on the GPUs, or hide them to run on the CPU.
    """
    import torch

    from elastic_moe_plugin import cpu_runtime
    from elastic_moe_plugin.cpu_runtime import megatron_training

    if torch.cuda.is_available():
        raise cpu_runtime.MegatronCPUError(
            f"{CPU_FLAG} runs Megatron-LM on the CPU, but torch.cuda.is_available() is True "
            f"({torch.cuda.device_count()} CUDA device(s) visible) and the CPU runtime never hides a GPU. "
            f"To train on the GPUs, drop {CPU_FLAG}; to run on the CPU anyway, hide them: "
            f"CUDA_VISIBLE_DEVICES= python -m {PROG} {CPU_FLAG} ..."
        )
    if "TORCH_COMPILE_DISABLE" not in os.environ:
        # Megatron's jit_fuser compiles each fused function with inductor: slow on CPU (docs/performance.md),
        # and it needs a C++ compiler
        cpu_runtime.disable_torch_compile()
    cpu_runtime.enable(training=True)
    megatron_training.enable()


def _has_flag(megatron_args: Sequence[str], flag: str) -> bool:
    return any(arg == flag or arg.startswith(f"{flag}=") for arg in megatron_args)


def cpu_megatron_args(megatron_args: Sequence[str]) -> list[str]:
    """Megatron's arguments for a ``--cpu`` run: a hybrid model (``--hybrid-layer-pattern`` or the
    deprecated ``--hybrid-override-pattern``) without ``--spec`` gets :data:`CPU_HYBRID_SPEC` appended,
    since Megatron-LM's default hybrid stack spec is built of Transformer Engine modules; anything
    else is returned unchanged (a copy)."""
    megatron_args = list(megatron_args)
    hybrid = any(_has_flag(megatron_args, flag) for flag in megatron_args_module.LAYERS_DERIVED_BY)
    if not hybrid or _has_flag(megatron_args, SPEC_FLAG):
        return megatron_args
    if int(os.environ.get("RANK", "0")) == 0:
        print(
            f"elastic-moe: {CPU_FLAG}: a hybrid model without {SPEC_FLAG}: added {' '.join(CPU_HYBRID_SPEC)} "
            "(the CPU runtime's local stack spec; Megatron's default is Transformer Engine's)",
            file=sys.stderr,
            flush=True,
        )
    return [*megatron_args, *CPU_HYBRID_SPEC]


def _fail(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if [a for a in argv[:2] if a != CPU_FLAG][:1] in (["-h"], ["--help"]):
        print(f"usage: {USAGE}\n\n{CPU_HELP}\n\n{__doc__}")
        return 0
    try:
        launch = parse_argv(argv)
    except ConfigError as error:
        return _fail(str(error))
    if not os.path.isfile(launch.script):
        return _fail(f"training script {launch.script!r} does not exist.")
    # what Megatron-LM's flags already decide is refused now, before Megatron initialises anything
    try:
        megatron_args_module.check_megatron_args(launch.config, launch.megatron_args)
    except (ConfigError, UnsupportedMegatronError) as error:
        return _fail(str(error))
    if not launch.cpu:
        mcore_megatron_lm.run(launch.config, launch.script, launch.megatron_args)
        return 0
    from elastic_moe_plugin.cpu_runtime import MegatronCPUError

    try:
        enable_cpu_runtime()
        if int(os.environ.get("RANK", "0")) == 0:
            print(
                f"elastic-moe: {CPU_FLAG}: Megatron runs on the CPU (elastic_moe_plugin.cpu_runtime, training loop "
                f"included; torch.compile {'off' if os.environ.get('TORCH_COMPILE_DISABLE') == '1' else 'on'})",
                file=sys.stderr,
                flush=True,
            )
        megatron_args = cpu_megatron_args(launch.megatron_args)
        mcore_megatron_lm.run(launch.config, launch.script, megatron_args)
    except MegatronCPUError as error:
        # what the CPU runtime refuses (CUDA visible, a flag no CPU run can do without, a GPU-only
        # kernel launched) is said in full by its message, on every rank
        return _fail(str(error))
    return 0


__all__ = [
    "CPU_FLAG",
    "CPU_HYBRID_SPEC",
    "Launch",
    "cpu_megatron_args",
    "enable_cpu_runtime",
    "main",
    "parse_argv",
    "split_argv",
]

if __name__ == "__main__":
    sys.exit(main())

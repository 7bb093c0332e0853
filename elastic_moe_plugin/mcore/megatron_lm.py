"""Run a Megatron-LM training script with Elastic Expert Routing applied.

::

    python -m elastic_moe_plugin.megatron_lm PATH/TO/pretrain_gpt.py <megatron args> \\
        --elastic-moe-schedule 6-10 [--elastic-moe-layers 3-7 ...]

    torchrun --nnodes 2 --nproc-per-node 8 ... -m elastic_moe_plugin.megatron_lm \\
        PATH/TO/pretrain_gpt.py <megatron args> --elastic-moe-schedule 6-10

Every rank runs this module. It

1. takes the ``--elastic-moe-*`` flags out of the command line (anywhere after the script path)
   before Megatron parses its arguments, so Megatron never sees them; a misspelt
   ``--elastic-moe-...`` flag is an error here rather than an "unrecognized arguments" there;
2. builds the :class:`~elastic_moe_plugin.core.config.ElasticConfig` from defaults < YAML
   (``--elastic-moe-config`` / ``ELASTIC_MOE_CONFIG``) < ``ELASTIC_MOE_*`` < the flags, checked against
   the model Megatron's flags describe (``--moe-router-topk``, ``--num-experts``, ``--num-layers``),
   and refuses every other option those flags already decide (``--moe-router-fusion``, sinkhorn or
   quantile balancing, ...: :mod:`elastic_moe_plugin.mcore.megatron_args`), all before Megatron
   initialises anything; then applies
   :func:`elastic_moe_plugin.mcore.apply` (a class-level patch of ``TopKRouter``, so routers built
   later by the script route elastically in training);
3. unless ``--elastic-moe-log-metrics false``, installs :mod:`elastic_moe_plugin.mcore.training_log`:
   at every ``--log-interval`` step the routing metrics go to Megatron-LM's TensorBoard / W&B
   writers and its console line (installed when the script imports ``megatron.training``);
4. runs the script in this process as ``__main__`` (``runpy.run_path``), with ``sys.argv`` set to
   the script and the remaining Megatron arguments. The script's folder is put first on
   ``sys.path`` before step 2 imports megatron, as ``python SCRIPT`` would have it, so a
   Megatron-LM checkout's ``megatron`` package serves both the patch and the script.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import runpy
import shlex
import sys
from typing import Sequence

from elastic_moe_plugin.core.config import ConfigError, ElasticConfig, add_cli_arguments, config_from_cli
from elastic_moe_plugin.core.errors import UnsupportedMegatronError
from elastic_moe_plugin.mcore import megatron_args as megatron_args_module

FLAG_PREFIX = "--elastic-moe-"
#: an option of this entry point, not of ElasticConfig: Megatron-LM's log gets the routing metrics
LOG_METRICS_FLAG = FLAG_PREFIX + "log-metrics"
USAGE = ("python -m elastic_moe_plugin.megatron_lm PATH/TO/pretrain_gpt.py [megatron args] "
         "[--elastic-moe-schedule 6-10] [--elastic-moe-layers 3-7] [--elastic-moe-<field> VALUE ...] "
         "[--elastic-moe-log-metrics true|false]")
_BOOLEANS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


@dataclasses.dataclass(frozen=True)
class Launch:
    """What the command line asks for: the routing config, the script, Megatron's own arguments,
    and whether routing metrics go to Megatron-LM's log."""

    config: ElasticConfig
    script: str
    megatron_args: list[str]
    log_metrics: bool = True


def parse_argv(argv: Sequence[str], environ=None) -> Launch:
    """``argv`` (without the program name) -> :class:`Launch`.

    Raises:
        ConfigError: no script given, an unknown ``--elastic-moe-*`` flag, or an invalid value.
    """
    parser = argparse.ArgumentParser(prog="elastic_moe_plugin.megatron_lm", add_help=False, allow_abbrev=False)
    add_cli_arguments(parser, prefix=FLAG_PREFIX)
    parser.add_argument(LOG_METRICS_FLAG, dest="elastic_moe_log_metrics", default="true", metavar="BOOL")
    known, rest = parser.parse_known_args(list(argv))
    flags = [a.split("=", 1)[0] for a in parser._option_string_actions]  # noqa: SLF001 - argparse's own table
    stray = [a for a in rest if a.startswith(FLAG_PREFIX)]
    if stray:
        raise _unknown_flags(stray, rest, flags)
    if not rest or rest[0].startswith("-"):
        raise ConfigError(f"no training script given. Usage: {USAGE}")
    script, megatron_args = rest[0], rest[1:]
    if not script.endswith(".py"):
        raise ConfigError(f"{script!r} is not a Python script. Usage: {USAGE}")
    log_metrics = _BOOLEANS.get(str(known.elastic_moe_log_metrics).strip().lower())
    if log_metrics is None:
        typed = shlex.quote(str(known.elastic_moe_log_metrics))
        raise ConfigError(f"{LOG_METRICS_FLAG} {typed} is invalid: expected true or false (1/0, yes/no, on/off). "
                          f"Pass {LOG_METRICS_FLAG} true for the routing metrics in Megatron-LM's log, or "
                          f"{LOG_METRICS_FLAG} false to keep them out.", field="log_metrics",
                          fixes=({"log_metrics": True}, {"log_metrics": False}))
    # the model the flags decide: the config's own checks, and every fix it suggests, are against it
    model = megatron_args_module.model_shape(megatron_args)
    return Launch(config_from_cli(known, environ, model=model), script, megatron_args, log_metrics)


def _unknown_flags(stray: list[str], rest: list[str], flags: list[str]) -> ConfigError:
    """An unknown ``--elastic-moe-*`` flag: the closest known one and, for a field, the fix renamed."""
    hints, fixes, renames = [], [], {}
    for arg in stray:
        name, sep, value = arg.partition("=")
        if not sep:
            after = rest.index(arg) + 1
            value = rest[after] if after < len(rest) and not rest[after].startswith("-") else None
        close = difflib.get_close_matches(name, flags, n=1)
        field = close[0][len(FLAG_PREFIX):].replace("-", "_") if close else None
        if close and value is not None and field in ElasticConfig.field_names():
            renames[name] = close[0]
            fixes.append({field: value})
            hints.append(f"{name} (did you mean {close[0]}? {close[0]} {shlex.quote(value)})")
        else:
            hints.append(name + (f" (did you mean {close[0]}?)" if close else ""))
    return ConfigError(f"unknown elastic-moe flag(s): {', '.join(hints)}. Accepted: {', '.join(sorted(flags))}.",
                       fixes=tuple(fixes), renames=renames)


def split_argv(argv: Sequence[str], environ=None) -> tuple[ElasticConfig, str, list[str]]:
    """``argv`` (without the program name) -> (config, script path, Megatron's own arguments).

    Raises:
        ConfigError: as :func:`parse_argv`.
    """
    launch = parse_argv(argv, environ)
    return launch.config, launch.script, launch.megatron_args


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(f"usage: {USAGE}\n\n{__doc__}")
        return 0
    try:
        launch = parse_argv(argv)
    except ConfigError as error:
        print(f"elastic_moe_plugin.megatron_lm: error: {error}", file=sys.stderr)
        return 2
    config, script, megatron_args = launch.config, launch.script, launch.megatron_args
    if not os.path.isfile(script):
        print(f"elastic_moe_plugin.megatron_lm: error: training script {script!r} does not exist.", file=sys.stderr)
        return 2
    # what Megatron-LM's flags already decide is refused now, before Megatron initialises anything
    try:
        megatron_args_module.check_megatron_args(config, megatron_args)
    except (ConfigError, UnsupportedMegatronError) as error:
        print(f"elastic_moe_plugin.megatron_lm: error: {error}", file=sys.stderr)
        return 2
    # The script's folder goes first on sys.path *before* megatron is imported, as `python SCRIPT`
    # would have it: a Megatron-LM checkout's own megatron/ package then serves both the patch and
    # the script, even when a megatron-core wheel is installed as well.
    script_dir = os.path.dirname(os.path.abspath(script))
    if not sys.path or sys.path[0] != script_dir:
        sys.path.insert(0, script_dir)
    from elastic_moe_plugin import mcore
    from elastic_moe_plugin.mcore import training_log

    mcore.apply(config)
    if launch.log_metrics:
        training_log.install()
    if int(os.environ.get("RANK", "0")) == 0:
        logged = "routing metrics in Megatron-LM's log" if launch.log_metrics else f"{LOG_METRICS_FLAG} false"
        print(f"elastic-moe: {config}; {logged}; running {script}", file=sys.stderr, flush=True)
    sys.argv = [script, *megatron_args]
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())

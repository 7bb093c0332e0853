"""Run a Megatron-LM training script in this process with Elastic Expert Routing applied.

The command line (``python -m elastic_moe_plugin.megatron_lm [--cpu] SCRIPT ...``) is parsed by the
entry point, :mod:`elastic_moe_plugin.megatron_lm`; :func:`run` does the Megatron side, on every rank:

1. puts the script's folder first on ``sys.path`` *before* megatron is imported, as ``python SCRIPT``
   would have it: a Megatron-LM checkout's own ``megatron`` package then serves both the patch and
   the script, even when a megatron-core wheel is installed as well;
2. applies :func:`elastic_moe_plugin.mcore.apply` (a class-level patch of ``TopKRouter``, so routers
   built later by the script route elastically in training);
3. prints the start-up plan line once Megatron-LM has built the model
   (:func:`.training_log.install_plan_line`) and, unless ``ElasticConfig.log_metrics`` is ``off``,
   installs :mod:`elastic_moe_plugin.mcore.training_log`: at every ``--log-interval`` step the
   routing metrics go to Megatron-LM's TensorBoard / W&B writers (every layer's too with ``layers``
   and ``--moe-per-layer-logging``) and its console line (both installed when the script imports
   ``megatron.training``);
4. runs the script as ``__main__`` (``runpy.run_path``), with ``sys.argv`` set to the script and
   Megatron's own arguments.
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Sequence

from elastic_moe_plugin.core.config import ElasticConfig

#: what the banner says Megatron-LM's log gets, per ``ElasticConfig.log_metrics``
_LOGGED = {
    "layers": "routing metrics in Megatron-LM's log: layer means, every layer's too with --moe-per-layer-logging",
    "means": "routing metrics in Megatron-LM's log: layer means",
    "off": "no routing metrics in Megatron-LM's log",
}


def run(config: ElasticConfig, script: str, megatron_args: Sequence[str]) -> None:
    """Steps 1-4 of the module docstring. ``script`` must exist (the entry point checks it)."""
    script_dir = os.path.dirname(os.path.abspath(script))
    if not sys.path or sys.path[0] != script_dir:
        sys.path.insert(0, script_dir)
    from elastic_moe_plugin import mcore
    from elastic_moe_plugin.mcore import training_log

    mcore.apply(config)
    training_log.install_plan_line()
    if config.log_metrics != "off":
        training_log.install()
    if int(os.environ.get("RANK", "0")) == 0:
        logged = f"{_LOGGED[config.log_metrics]} ({config.spell('log_metrics')})"
        print(f"elastic-moe: {config}; {logged}; running {script}", file=sys.stderr, flush=True)
    sys.argv = [script, *megatron_args]
    runpy.run_path(script, run_name="__main__")


__all__ = ["run"]

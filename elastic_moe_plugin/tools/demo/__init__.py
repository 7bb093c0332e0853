"""``elastic-moe demo``: train a tiny Megatron-core MoE GPT twice on CPU, static top-k and elastic.

Same data, seed and token budget for both runs, through the patch layer users use on GPUs
(``mcore.patched(ElasticConfig(schedule="static"))``, then ``schedule="2-6", sigma=1.5``), on the
real megatron-core code with the CPU compatibility layer (:mod:`elastic_moe_plugin.cpu_runtime`).
``elastic-moe compare --device cuda`` trains the same runs on one CUDA GPU instead, through
Megatron's own CUDA path (``DemoSettings.device``; :mod:`.device`).
``docs/demo.md`` shows the demo's output; at this size elastic routing is not expected to beat
static top-k (the paper's gains were measured on 1B-30B-parameter models).

Modules, one job each:

- :mod:`.settings`: :class:`DemoSettings` and the constants of the output format;
- :mod:`.device`: where the runs train, the CPU runtime or one CUDA GPU, and their set-up;
- :mod:`.corpus`: the synthetic six-task mixture or a file as bytes, split into train / held-out;
- :mod:`.model`: the ``GPTModel`` description, building it and :func:`load_trained`;
- :mod:`.stats`: router hooks, realised κ, exposure and tokens-per-expert imbalance;
- :mod:`.progress`: the progress bar on stderr;
- :mod:`.train`: the training loop, evaluation, the lr schedule and one or both runs;
- :mod:`.report`: ``summary.json``, ``model_config.json`` and the printed table;
- :mod:`.plots`: the three PNGs.

The command line is :mod:`elastic_moe_plugin.cli.demo`.
"""

from __future__ import annotations

import importlib
from typing import Any

#: public name -> the module that defines it. Loaded on first access, so that importing the light
#: :mod:`.settings` (``elastic-moe demo --help`` reads its defaults) does not load the training code.
_EXPORTS = {
    "CORPUS_SEED": "settings",
    "DEVICES": "settings",
    "FORMAT": "settings",
    "PAPER_NOTE": "settings",
    "QUICK": "settings",
    "DemoSettings": "settings",
    "SYNTHETIC_VOCAB": "corpus",
    "TASKS": "corpus",
    "Corpus": "corpus",
    "SyntheticLanguages": "corpus",
    "file_corpus": "corpus",
    "synthetic_corpus": "corpus",
    "build_model": "model",
    "causal_mask": "model",
    "load_trained": "model",
    "model_config": "model",
    "RoutingStats": "stats",
    "evaluate": "train",
    "train_run": "train",
    "train_runs": "train",
    "format_table": "report",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))

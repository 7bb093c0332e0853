"""Start-up module of ``elastic-moe bench --only e2e``: the host syncs of one Megatron training step.

On ``PYTHONPATH`` of the bench's ``megatron sft`` and Megatron-LM runs (after the CPU runtime's
bootstrap, which runs this module after itself), it does nothing unless ``E2E_BENCH_SYNC_STEP`` is
set. Then it wraps the trainer's ``train_step`` as soon as its module is imported
(``$E2E_BENCH_SYNC_TARGET``: ``megatron_lm`` for ``megatron.training.training.train_step``,
``megatron_swift`` for ``swift.megatron.trainers.base.BaseMegatronTrainer.train_step``) so that call
number ``$E2E_BENCH_SYNC_STEP`` (one training iteration: every micro-batch's forward and backward,
the optimizer step) runs under :class:`~elastic_moe_plugin.tools.bench.measure.SyncCounter`; rank 0
writes ``{"syncs": n}`` to ``$E2E_BENCH_SYNC_OUT``. Every other call runs untouched.

A ``sitecustomize`` this folder shadows (one later on ``sys.path`` than this folder) is run afterwards.
"""

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys

TARGETS = {  # target -> (module, class or None, function)
    "megatron_lm": ("megatron.training.training", None, "train_step"),
    "megatron_swift": ("swift.megatron.trainers.base", "BaseMegatronTrainer", "train_step"),
}


def _counted(function, step: int, out: str):
    calls = [0]

    @functools.wraps(function)
    def train_step(*args, **kwargs):
        calls[0] += 1
        if calls[0] != step or os.environ.get("RANK", "0") != "0":
            return function(*args, **kwargs)
        from elastic_moe_plugin.tools.bench.measure import SyncCounter

        with SyncCounter() as counter:
            result = function(*args, **kwargs)
        with open(out, "w") as sink:
            json.dump({"syncs": counter.count}, sink)
        return result

    return train_step


class _WrapOnImport(importlib.abc.MetaPathFinder):
    """Finds the target module with the other finders, then wraps its function once it has run."""

    def __init__(self, module: str, owner, function: str, step: int, out: str) -> None:
        self.module, self.owner, self.function, self.step, self.out = module, owner, function, step, out

    def find_spec(self, name, path=None, target=None):
        if name != self.module:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_wrap(module):
            exec_module(module)
            holder = getattr(module, self.owner) if self.owner else module
            setattr(holder, self.function, _counted(getattr(holder, self.function), self.step, self.out))

        spec.loader.exec_module = exec_and_wrap
        return spec


def _install() -> None:
    step = os.environ.get("E2E_BENCH_SYNC_STEP")
    if not step:
        return
    module, owner, function = TARGETS[os.environ["E2E_BENCH_SYNC_TARGET"]]
    sys.meta_path.insert(0, _WrapOnImport(module, owner, function, int(step), os.environ["E2E_BENCH_SYNC_OUT"]))


def _run_shadowed_sitecustomize() -> None:
    # only the entries after this folder: the CPU runtime's bootstrap, before it, has already run
    here = os.path.dirname(os.path.abspath(__file__))
    absolute = [os.path.abspath(entry) if entry else "" for entry in sys.path]
    after = absolute.index(here) + 1 if here in absolute else 0
    entries = [entry for entry in sys.path[after:] if entry and os.path.abspath(entry) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", entries)
    if spec is None or spec.origin is None or os.path.abspath(spec.origin) == os.path.abspath(__file__):
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["_elastic_moe_bench_shadowed_sitecustomize"] = module
    spec.loader.exec_module(module)


_install()
_run_shadowed_sitecustomize()

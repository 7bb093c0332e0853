"""Start-up probe of the DeepSpeed engine a ``swift sft`` rank builds, for tests/swift/test_rehearse.py
and tests/swift/test_swift_engines.py.

Run at interpreter start in every process of a launcher (:data:`START_UP_LINE`, in a
``sitecustomize`` that :func:`sitecustomize_dir` writes, which the child bootstrap runs after its own
(``elastic_moe_plugin.tools.child_bootstrap``), or in a ``.pth`` next to the tests' start-up hook's),
with ``ENGINE_PROBE_DIR`` set: once
``deepspeed.runtime.engine`` is imported it wraps ``DeepSpeedEngine.__init__``, and after the stock
``__init__`` writes ``ENGINE_PROBE_DIR/rank<R>.json`` with what that rank's engine holds:

- ``stage``: the engine's ZeRO stage, ``world``: the size of its data-parallel world;
- ``params``: the model's parameters, ``params_total``: their elements (``ds_numel`` where ZeRO-3
  partitioned them);
- ``params_local``: elements this rank holds (its ``ds_tensor`` partition under ZeRO-3, else the
  whole parameter), ``params_partitioned``: parameters held as a ZeRO-3 partition (not persistent);
- ``optimizer_local``: elements of this rank's fp32 partition of the optimizer's flat groups
  (ZeRO-1/2: ``single_partition_of_fp32_groups``, ZeRO-3: ``fp32_partitioned_groups_flat``).

Without ``ENGINE_PROBE_DIR`` it does nothing.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

PROBE_ENV = "ENGINE_PROBE_DIR"


#: the line that runs this file: a ``sitecustomize.py`` of it, or a ``.pth`` file's ``import`` line
START_UP_LINE = f"import runpy; runpy.run_path({str(Path(__file__).resolve())!r})"


def sitecustomize_dir(folder: Path) -> Path:
    """``folder`` with a ``sitecustomize.py`` that runs this file; put it on ``PYTHONPATH``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(START_UP_LINE + "\n")
    return folder


def _record(engine) -> dict:
    from deepspeed import comm

    params = list(engine.module.parameters())
    partitioned = [p for p in params if hasattr(p, "ds_tensor") and not getattr(p, "ds_persist", False)]
    optimizer = getattr(engine, "optimizer", None)
    flat = getattr(optimizer, "single_partition_of_fp32_groups", None)
    if flat is None:
        flat = getattr(optimizer, "fp32_partitioned_groups_flat", None) or []
    return {
        "rank": comm.get_rank(),
        "world": comm.get_world_size(),
        "stage": engine.zero_optimization_stage(),
        "params": len(params),
        "params_total": sum(getattr(p, "ds_numel", p.numel()) for p in params),
        "params_local": sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in params),
        "params_partitioned": len(partitioned),
        "optimizer_local": sum(t.numel() for t in flat),
    }


def _wrap(module) -> None:
    stock = module.DeepSpeedEngine.__init__

    @functools.wraps(stock)
    def __init__(self, *args, **kwargs):
        stock(self, *args, **kwargs)
        record = _record(self)
        folder = Path(os.environ[PROBE_ENV])
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"rank{record['rank']}.json").write_text(json.dumps(record))

    module.DeepSpeedEngine.__init__ = __init__


if os.environ.get(PROBE_ENV):
    from elastic_moe_plugin.core.import_hooks import IMPORT_HOOKS

    IMPORT_HOOKS.after_import("deepspeed.runtime.engine", _wrap)

"""ms-swift plugin file of the ``swift sft`` bench (``elastic-moe bench --only e2e`` and
``--only swift-profile``): a profiler and a sync counter over training steps.

Loaded next to the elastic-moe plugin by ``--external_plugins`` (``swift sft`` imports it before the
model is built); it registers two callbacks, each enabled by ``--callbacks NAME``:

- ``sft_profile`` (:class:`StepProfiler`): torch.profiler over the host (CPU activities, no shapes, no
  memory) from the start of step ``first + 1`` to the end of step ``first + count``; writes
  ``{op name: [self CPU µs, calls]}`` over those steps to the JSON file ``$SWIFT_SFT_PROFILE_OUT``.
  Set ``SWIFT_SFT_PROFILE_STEPS=first:count`` (e.g. ``5:3``).
- ``sft_syncs`` (:class:`StepSyncs`): :class:`~elastic_moe_plugin.tools.bench.measure.SyncCounter` (the
  aten ops that read a device value on the host) from the start to the end of step
  ``$E2E_BENCH_SYNC_STEP`` (1-based: forward, backward, optimizer step and the trainer's own reads);
  writes ``{"syncs": n}`` to ``$E2E_BENCH_SYNC_OUT``.

It lies alone in its folder: ms-swift puts a plugin file's folder first on ``sys.path``.
"""

from __future__ import annotations

import json
import os

import torch
from swift.callbacks.mapping import callbacks_map
from transformers import TrainerCallback


class StepProfiler(TrainerCallback):
    """torch.profiler around steps ``first + 1 .. first + count`` (``SWIFT_SFT_PROFILE_STEPS``)."""

    def __init__(self, args, trainer):
        first, count = (int(part) for part in os.environ["SWIFT_SFT_PROFILE_STEPS"].split(":"))
        self.first, self.last = first, first + count
        self.out = os.environ["SWIFT_SFT_PROFILE_OUT"]
        self.profiler = None

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.first and self.profiler is None:  # global_step: steps completed
            self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self.profiler.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.last and self.profiler is not None:
            self.profiler.__exit__(None, None, None)
            table = {event.key: [event.self_cpu_time_total, event.count] for event in self.profiler.key_averages()}
            with open(self.out, "w") as sink:
                json.dump(table, sink)


class StepSyncs(TrainerCallback):
    """Host syncs of step ``$E2E_BENCH_SYNC_STEP`` (1-based), written to ``$E2E_BENCH_SYNC_OUT``."""

    def __init__(self, args, trainer):
        from elastic_moe_plugin.tools.bench.e2e_child import SYNC_OUT_ENV, SYNC_STEP_ENV

        self.step = int(os.environ[SYNC_STEP_ENV])
        self.out = os.environ[SYNC_OUT_ENV]
        self.counter = None

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step - 1 and self.counter is None and state.is_world_process_zero:
            from elastic_moe_plugin.tools.bench.measure import SyncCounter

            self.counter = SyncCounter()
            self.counter.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step and self.counter is not None:
            self.counter.__exit__(None, None, None)
            with open(self.out, "w") as sink:
                json.dump({"syncs": self.counter.count}, sink)
            self.counter = None


callbacks_map["sft_profile"] = StepProfiler
callbacks_map["sft_syncs"] = StepSyncs

"""ms-swift plugin file of ``scripts/swift_sft_speed.py --profile``: torch.profiler over training steps.

Loaded next to the elastic-moe plugin by ``--external_plugins`` (``swift sft`` imports it before the
model is built) and enabled with ``--callbacks sft_profile``. It registers the callback
:class:`StepProfiler`, which profiles the host (CPU activities, no shapes, no memory) from the start
of step ``first + 1`` to the end of step ``first + count`` and writes, to the JSON file
``$SWIFT_SFT_PROFILE_OUT``, ``{op name: [self CPU µs, calls]}`` over those steps. Set
``SWIFT_SFT_PROFILE_STEPS=first:count`` (e.g. ``5:3``).
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


callbacks_map["sft_profile"] = StepProfiler

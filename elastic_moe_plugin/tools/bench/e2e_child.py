"""A launcher's run in ``elastic-moe bench --only e2e`` (:mod:`.e2e`): its command, its environment,
and the variables of the step probe, :mod:`.step_probe` (:mod:`.e2e_swift`, :mod:`.e2e_megatron`,
:mod:`.e2e_titan` build on it)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

SYNC_STEP_ENV, SYNC_OUT_ENV, TARGET_ENV = "E2E_BENCH_SYNC_STEP", "E2E_BENCH_SYNC_OUT", "E2E_BENCH_TARGET"
INTERLEAVE_BLOCK_ENV, INTERLEAVE_OUT_ENV = "E2E_BENCH_INTERLEAVE_BLOCK", "E2E_BENCH_INTERLEAVE_OUT"


class LauncherUnavailable(RuntimeError):
    """A launcher's ``prepare`` found its framework missing here: the bench leaves its row out and
    says why (the message names what is missing and how to get it)."""


@dataclass
class Command:
    """One run of a launcher: its command line, environment and working folder."""

    argv: list[str]
    env: dict[str, str]
    cwd: Path


@dataclass
class RunReading:
    """What a finished run's logs say."""

    steps_per_second: float
    mean_kappa: float | None
    logged_steps: int


def child_env(**extra: str) -> dict[str, str]:
    """This environment for a launcher's child: offline, CPU-only, one torch thread, this package
    first on ``PYTHONPATH``, and nothing of a surrounding run (``ELASTIC_MOE_*``, the child
    bootstrap's ``EMOE_BOOTSTRAP``, torchrun's variables) that would change what the child does."""
    drop = ("ELASTIC_MOE_", "EMOE_", "MASTER_", "TORCHELASTIC_", "PET_", "E2E_BENCH_")
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(drop)
        and key
        not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NPROC_PER_NODE", "NNODES", "SWIFT_CONFIG_FILE")
    }
    package_root = str(Path(__file__).resolve().parents[3])
    env.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        TORCH_COMPILE_DISABLE="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join([package_root, *filter(None, [os.environ.get("PYTHONPATH")])]),
    )
    env.update(extra)
    return env


def probe_env(out: Path, step: int, target: str, interleave_block: int | None) -> dict[str, str]:
    """The step probe's variables (:mod:`.step_probe`): count the syncs of call ``step``, or interleave
    blocks (and count the syncs of each mode's first call after the warm-up of ``step`` calls)."""
    if interleave_block:
        return {
            INTERLEAVE_BLOCK_ENV: str(interleave_block),
            INTERLEAVE_OUT_ENV: str(out / "interleaved.json"),
            SYNC_STEP_ENV: str(step),
            TARGET_ENV: target,
        }
    return {SYNC_STEP_ENV: str(step), SYNC_OUT_ENV: str(out / "syncs.json"), TARGET_ENV: target}


def console_script(name: str) -> str:
    """``swift`` / ``megatron`` of this interpreter's environment."""
    script = Path(sys.executable).with_name(name)
    if not script.exists():
        raise RuntimeError(f"'{script}' does not exist; install ms-swift (pip install 'ms-swift>=4.6,<4.7').")
    return str(script)


__all__ = [
    "INTERLEAVE_BLOCK_ENV",
    "INTERLEAVE_OUT_ENV",
    "SYNC_OUT_ENV",
    "SYNC_STEP_ENV",
    "TARGET_ENV",
    "Command",
    "LauncherUnavailable",
    "RunReading",
    "child_env",
    "console_script",
    "probe_env",
]

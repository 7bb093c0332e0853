"""The tool tests; the Megatron fixtures serve the bench and the demo/diagnostics tests that load
Megatron checkpoints (those are marked ``megatron``).

``demo_quick`` (session): one ``elastic-moe demo --quick`` in a fresh process, its output folder,
summary and streams, read by the demo's tests and by ``diagnose`` on real demo output; ``run_demo``:
the same command with other options."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from megatron_support import *  # noqa: F401,F403 - the shared Megatron fixtures


def _run_demo(out: Path, *extra: str) -> tuple[dict, str, str]:
    """``elastic-moe demo --quick --out OUT EXTRA...`` in a subprocess: (summary.json, stdout, stderr)."""
    env = dict(os.environ, TORCH_COMPILE_DISABLE="1")
    proc = subprocess.run(
        [sys.executable, "-m", "elastic_moe_plugin.cli", "demo", "--quick", "--out", str(out), *extra],
        capture_output=True, text=True, env=env, timeout=600, check=False,
    )
    assert proc.returncode == 0, f"demo failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return json.loads((out / "summary.json").read_text()), proc.stdout, proc.stderr


@pytest.fixture(scope="session")
def demo_quick(tmp_path_factory) -> tuple[Path, dict, str, str]:
    """(output folder, summary, stdout, stderr) of one ``elastic-moe demo --quick``."""
    out = tmp_path_factory.mktemp("demo_quick")
    return (out, *_run_demo(out))


@pytest.fixture
def run_demo():
    """``run_demo(out, *extra)``: another demo run, with options, as (summary, stdout, stderr)."""
    return _run_demo

"""``scripts/gpu_check.sh``, checked without a GPU and without training.

- the script parses (``bash -n``);
- its ``compare_study`` section is a section like the others (run when wanted, before the final
  line), and its default flags are a GPU-sized study that the real ``elastic-moe compare`` parser
  accepts: ``--device cuda --scale 100``, two seeds, static against 2-6;
- on a machine without CUDA, that section fails with compare's own refusal (a failed study is not
  taken for a passed section).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check.sh"


def _script() -> str:
    return SCRIPT.read_text()


def _section(name: str) -> str:
    """The body of the shell function ``name`` (from its ``name() {`` line to its closing ``}``)."""
    match = re.search(rf"^{name}\(\) \{{\n(.*?)^\}}\n", _script(), re.MULTILINE | re.DOTALL)
    assert match, f"no function {name} in {SCRIPT}"
    return match.group(1)


def test_the_script_parses():
    result = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr


def test_compare_study_is_a_section_run_when_wanted_before_the_final_line():
    script = _script()
    call = "if wanted compare_study; then compare_study; fi"
    assert script.count(call) == 1
    assert script.index(call) < script.index('echo "gpu_check: every section run passed')
    assert "# End of section: a GPU-sized elastic-moe compare study" in script
    # the header says how to dry-run it on a CPU
    assert 'GPU_CHECK_SECTIONS=compare_study GPU_CHECK_COMPARE_ARGS="--device cpu --quick --steps 4"' in script


def test_compare_study_trains_a_gpu_sized_study_by_default_then_reports_it():
    from elastic_moe_plugin.cli.compare import configure_parser, plan_from_args

    body = _section("compare_study")
    assert '-m elastic_moe_plugin.cli compare "${args[@]}" --out "$dir"' in body
    assert '-m elastic_moe_plugin.cli compare --report --out "$dir"' in body
    assert 'timeout "$budget"' in body and "GPU_CHECK_COMPARE_TIMEOUT:-540" in body
    default = re.search(r"\$\{GPU_CHECK_COMPARE_ARGS:-([^}]*)\}", body)
    assert default, body
    flags = shlex.split(default.group(1))
    assert flags[:4] == ["--device", "cuda", "--scale", "100"]
    parser = argparse.ArgumentParser()
    configure_parser(parser)
    args = parser.parse_args([*flags, "--out", "unused"])  # the real CLI's parser accepts them
    plan = plan_from_args(args)
    assert plan.settings.device == "cuda" and plan.settings.num_layers == 8 and plan.settings.hidden_size == 512
    assert plan.settings.steps == 1000 and plan.seeds == (0, 1) and plan.arms == ("static", "2-6")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the section's failure on a machine without CUDA")
def test_compare_study_fails_with_compares_refusal_without_cuda(tmp_path):
    env = dict(
        os.environ,
        GPU_CHECK_SECTIONS="compare_study",
        GPU_CHECK_COMPARE_ARGS="--device cuda --quick --steps 1",
        PYTHON=sys.executable,
        OMP_NUM_THREADS="1",
    )
    result = subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path)], capture_output=True, text=True, env=env, timeout=300, check=False
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "device='cuda' (--device cuda) trains on a CUDA GPU" in output
    assert "gpu_check: elastic-moe compare failed (exit status 2)" in output
    assert "every section run passed" not in output

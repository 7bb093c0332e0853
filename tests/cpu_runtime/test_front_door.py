"""The CPU runtime's front door: ``python -m elastic_moe_plugin.megatron_lm --cpu SCRIPT ...``.

Its runs of Megatron-LM's real trainer (1 rank with ``--elastic-moe-schedule 1-3``; TP=2 with
sequence parallelism on 2 gloo ranks, equal to the 1-rank run) are in
``tests/mcore/test_megatron_lm.py``; here the command line, the refusals and the help text.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from elastic_moe_plugin import cpu_runtime, megatron_lm
from elastic_moe_plugin.core.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "megatron_lm" / "pretrain_gpt_moe.py"


def test_cpu_is_an_option_of_the_entry_point_before_the_script():
    launch = megatron_lm.parse_argv(["--cpu", "train.py", "--lr", "1", "--elastic-moe-schedule", "1-3"], environ={})
    assert launch.cpu and launch.script == "train.py" and launch.megatron_args == ["--lr", "1"]
    assert launch.config.schedule == "1-3"
    assert megatron_lm.parse_argv(["train.py", "--lr", "1"], environ={}).cpu is False
    with pytest.raises(ConfigError, match=r"--cpu is an option of elastic_moe_plugin\.megatron_lm, not of "
                                          r"Megatron-LM: put it before the script path, python -m "
                                          r"elastic_moe_plugin\.megatron_lm --cpu train\.py"):
        megatron_lm.parse_argv(["train.py", "--lr", "1", "--cpu"], environ={})
    with pytest.raises(ConfigError, match="ignored explicit argument"):
        megatron_lm.parse_argv(["--cpu=yes", "train.py"], environ={})


def test_help_names_the_cpu_flag_and_the_flags_a_cpu_run_needs():
    result = subprocess.run([sys.executable, "-m", "elastic_moe_plugin.megatron_lm", "--help"], cwd=REPO,
                            capture_output=True, text=True, timeout=60, check=False,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])})
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: python -m elastic_moe_plugin.megatron_lm [--cpu] PATH/TO/pretrain_gpt.py")
    from elastic_moe_plugin.cpu_runtime.training_loop import CPU_ARGUMENTS

    for flag in ("--cpu (before the script path)", *(item.flag for item in CPU_ARGUMENTS), "--disable-bias-linear"):
        assert flag in result.stdout, flag
    assert "import megatron" not in result.stderr


def test_cpu_refuses_a_visible_gpu_and_names_both_fixes(monkeypatch, capsys):
    cpu_runtime.disable()
    try:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
        assert megatron_lm.main(["--cpu", str(SCRIPT), "--lr", "1"]) == 2
        error = capsys.readouterr().err
        assert error.startswith("elastic_moe_plugin.megatron_lm: error: --cpu runs Megatron-LM on the CPU, but "
                                "torch.cuda.is_available() is True (8 CUDA device(s) visible)"), error
        assert "To train on the GPUs, drop --cpu" in error
        assert "CUDA_VISIBLE_DEVICES= python -m elastic_moe_plugin.megatron_lm --cpu" in error
        assert not cpu_runtime.is_enabled()
    finally:
        monkeypatch.undo()
        cpu_runtime.enable()


def test_a_missing_script_is_reported_before_anything_is_switched_on(capsys):
    cpu_runtime.disable()
    try:
        assert megatron_lm.main(["--cpu", "no/such/pretrain_gpt.py"]) == 2
        assert "training script 'no/such/pretrain_gpt.py' does not exist" in capsys.readouterr().err
        assert not cpu_runtime.is_enabled()
    finally:
        cpu_runtime.enable()


def test_the_cpu_check_names_every_missing_flag_with_its_reason():
    import argparse

    from elastic_moe_plugin.cpu_runtime.training_loop import CPU_ARGUMENTS, check_cpu_arguments

    good = argparse.Namespace(**{item.attribute: item.value for item in CPU_ARGUMENTS})
    check_cpu_arguments(good)
    check_cpu_arguments(argparse.Namespace())  # a release without these attributes: nothing to check
    stock_defaults = argparse.Namespace(distributed_backend="nccl", transformer_impl="transformer_engine",
                                        gradient_accumulation_fusion=True, no_persist_layer_norm=False, clip_grad=1.0)
    with pytest.raises(cpu_runtime.MegatronCPUError) as raised:
        check_cpu_arguments(stock_defaults)
    message = str(raised.value)
    for item in CPU_ARGUMENTS:
        assert f"{item.flag} (got {getattr(stock_defaults, item.attribute)!r}: {item.reason})" in message
    assert message.endswith("A CPU run passes all of: --distributed-backend gloo --transformer-impl local "
                            "--no-gradient-accumulation-fusion --no-persist-layer-norm --clip-grad 0 "
                            "(docs/megatron.md, 'Megatron-LM on the CPU').")


def test_the_docs_section_the_messages_cite_lists_every_checked_flag():
    from elastic_moe_plugin.cpu_runtime.training_loop import CPU_ARGUMENTS

    assert "(docs/megatron.md, 'Megatron-LM on the CPU')" in megatron_lm.CPU_HELP
    page = (REPO / "docs" / "megatron.md").read_text()
    assert page.count("\n## Megatron-LM on the CPU\n") == 1
    section = page.split("\n## Megatron-LM on the CPU\n", 1)[1].split("\n## ", 1)[0]
    command = section.split("```bash", 1)[1].split("```", 1)[0]
    assert "-m elastic_moe_plugin.megatron_lm --cpu /path/to/Megatron-LM/pretrain_gpt.py" in command
    for item in CPU_ARGUMENTS:
        assert f"| `{item.flag}` | {item.reason}" in section, item.flag
        assert item.flag in command, item.flag
    assert "scripts/build_megatron_dataset_helpers.sh" in command
    assert (REPO / "scripts" / "build_megatron_dataset_helpers.sh").stat().st_mode & 0o111

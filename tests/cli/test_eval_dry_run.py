"""``elastic-moe eval --dry-run`` and ``--list-tasks`` in a process where lm-eval cannot be imported.

The process blocks ``lm_eval`` with a ``sys.meta_path`` finder that refuses it (``import lm_eval`` and
``importlib.util.find_spec("lm_eval")`` raise ModuleNotFoundError), which is what a venv without the
``[eval]`` extra looks like to the code. The checkpoints are config.json files only (a dry run reads
nothing else): a top-2 OLMoE of 8 experts and a dense Llama. One subprocess runs every command and
reports each exit status, output and whether lm_eval was ever imported.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

pytestmark = pytest.mark.hf

RUNNER = r"""
import contextlib, importlib.abc, io, json, sys

class NoLmEval(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "lm_eval" or name.startswith("lm_eval."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoLmEval())
from elastic_moe_plugin.cli import main

results = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    results.append({"argv": argv, "code": code, "out": out.getvalue(), "err": err.getvalue()})
print("RESULTS " + json.dumps({"results": results, "lm_eval_imported": "lm_eval" in sys.modules}))
"""


@pytest.fixture(scope="module")
def dry_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dry")
    moe, dense = tmp / "tiny-olmoe", tmp / "tiny-llama"
    moe.mkdir()
    dense.mkdir()
    (moe / "config.json").write_text(json.dumps({"model_type": "olmoe", "num_experts": 8, "num_experts_per_tok": 2,
                                                 "num_hidden_layers": 2, "hidden_size": 64}))
    (dense / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64}))
    commands = {
        "list": ["eval", "--suite", "avg9", "--list-tasks"],
        "dry": ["eval", str(moe), "--suite", "avg9", "--dry-run", "--out", str(tmp / "out")],
        "dry_topk": ["eval", str(moe), "--suite", "avg9", "--topk", "3", "--allow-code-execution", "--dry-run"],
        "dense": ["eval", str(dense), "--suite", "avg9", "--dry-run"],
        "topk_too_high": ["eval", str(moe), "--suite", "avg9", "--topk", "9", "--dry-run"],
        "real_run": ["eval", str(moe), "--suite", "avg9", "--out", str(tmp / "real")],
    }
    done = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(list(commands.values()))], capture_output=True,
                          text=True, timeout=300, cwd=tmp)
    line = next((line for line in done.stdout.splitlines() if line.startswith("RESULTS ")), None)
    assert done.returncode == 0 and line, done.stdout + done.stderr
    report = json.loads(line[len("RESULTS "):])
    return dict(zip(commands, report["results"])), report["lm_eval_imported"], tmp


def test_list_tasks_shows_each_task_its_shots_and_metric(dry_runs):
    runs, imported, _ = dry_runs
    listed = runs["list"]
    assert listed["code"] == 0, listed["err"]
    rows = {line.split()[0]: line.split()[1:4] for line in listed["out"].splitlines()[2:]}
    assert rows["MMLU"] == ["mmlu", "5", "acc,none"] and rows["BBH"] == ["bbh", "3", "exact_match,get-answer"]
    assert rows["GSM8K"] == ["gsm8k", "5", "exact_match,flexible-extract"] and len(rows) == 9
    assert not imported


def test_dry_run_resolves_the_suite_the_checkpoint_and_the_topk_without_lm_eval(dry_runs):
    runs, imported, tmp = dry_runs
    dry = runs["dry"]
    assert dry["code"] == 0, dry["err"]
    out = dry["out"]
    assert "checkpoint " in out and "(model_type='olmoe', num_experts_per_tok=2 of 8 experts)" in out
    assert "routing at inference: the checkpoint's own top-2" in out
    assert "  5-shot: mmlu, gsm8k\n" in out and "  0-shot: agieval_en, gpqa_main_zeroshot, ifeval, truthfulqa_mc2\n" in out
    assert "skipped MBPP: executes model-written code" in out
    assert "lm-eval is not installed: task names and metric keys are not checked" in out
    assert not (tmp / "out").exists()  # nothing written
    with_topk = runs["dry_topk"]
    assert with_topk["code"] == 0 and "--topk 3 (the checkpoint routes to top-2)" in with_topk["out"]
    assert "3-shot: bbh, mbpp" in with_topk["out"] and "skipped" not in with_topk["out"]
    assert not imported


def test_cheap_checks_come_before_the_lm_eval_import(dry_runs):
    """A dense checkpoint and a --topk above the experts are refused as such, with or without
    --dry-run; only what needs lm-eval stops at lm-eval."""
    runs, _, _ = dry_runs
    assert runs["dense"]["code"] == 2 and "is not a mixture-of-experts model" in runs["dense"]["err"]
    assert "model_type='llama'" in runs["dense"]["err"]
    assert runs["topk_too_high"]["code"] == 2 and "--topk 9 is invalid" in runs["topk_too_high"]["err"]
    real = runs["real_run"]
    assert real["code"] == 2 and "needs lm-evaluation-harness" in real["err"]


def test_dry_run_checks_the_registry_where_lm_eval_is_installed(tmp_path, capsys):
    pytest.importorskip("lm_eval")
    from elastic_moe_plugin.cli import main

    checkpoint = tmp_path / "tiny-olmoe"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"model_type": "olmoe", "num_experts": 8, "num_experts_per_tok": 2}))
    suite = Path(__file__).resolve().parents[1] / "fixtures" / "eval" / "tiny_suite.yaml"
    assert main(["eval", str(checkpoint), "--suite", str(suite), "--dry-run"]) == 0
    assert "every harness task and metric key is registered in lm-eval 0.4" in capsys.readouterr().out

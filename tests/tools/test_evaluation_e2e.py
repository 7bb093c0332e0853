"""``elastic-moe eval`` end to end on CPU: a tiny OLMoE built at test time, the tiny local suite in
tests/fixtures/eval/, lm-eval's own machinery, no downloads.

Pinned: the top-k override really changes routing (router outputs have k columns, logits move)
and restores every attribute afterwards, for OLMoE and Qwen3-MoE; ``--topk 1`` and ``--topk 3``
give different loglikelihoods and perplexity, both runs write raw results and a summary, and
``eval-table`` merges them; code execution is opt-in with a warning; a missing lm-eval, an
unknown task, a dense checkpoint and a missing vLLM each give a clear error.
"""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("lm_eval")

from elastic_moe_plugin.cli import main
from elastic_moe_plugin.tools.inference_topk import NotAMoEError, find_routers, transformers as topk_override
from elastic_moe_plugin.tools.eval import format_score

pytestmark = pytest.mark.hf

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "eval"
TINY_SUITE = FIXTURES / "tiny_suite.yaml"


def _builder():
    spec = importlib.util.spec_from_file_location("build_tiny_moe", FIXTURES / "build_tiny_moe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """A 64-wide model gains nothing from intra-op threads, and on a busy machine their spin-waits
    make each forward ~100x slower (1 s instead of 9 ms measured on 2 shared cores)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_olmoe(tmp_path_factory):
    return _builder().build_model(tmp_path_factory.mktemp("tiny-olmoe"), "olmoe")


def _eval(capsys, *argv):
    code = main(["eval", *map(str, argv), "--bootstrap-iters", "0"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# ---------------------------------------------------------------------------- top-k override


@pytest.mark.parametrize("model_type", ["olmoe", "qwen3_moe"])
def test_topk_override_changes_routing_and_restores(model_type):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    common = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=8,
        num_experts_per_tok=2,
        initializer_range=0.15,
    )
    if model_type == "qwen3_moe":
        common.update(moe_intermediate_size=16, head_dim=8)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **common)).eval()
    routers = find_routers(model)
    assert [name for name, _ in routers] == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    widths = []
    hooks = [router.register_forward_hook(lambda _m, _i, out: widths.append(out[2].shape[-1])) for _, router in routers]
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        base = model(ids).logits
        with topk_override(model, 1) as changed:
            assert changed == [name for name, _ in routers]
            assert model.config.num_experts_per_tok == 1 and model.num_experts_per_tok == 1
            top1 = model(ids).logits
        with topk_override(model, 3):
            top3 = model(ids).logits
        after = model(ids).logits
    for hook in hooks:
        hook.remove()
    assert widths == [2, 2, 1, 1, 3, 3, 2, 2]  # each router picked k experts per token
    assert not torch.allclose(top1, base) and not torch.allclose(top3, base) and not torch.allclose(top1, top3)
    assert torch.equal(after, base)  # restored exactly
    assert all(router.top_k == 2 for _, router in routers)
    assert model.config.num_experts_per_tok == 2 and model.num_experts_per_tok == 2


def _gemma4(top_k: int):
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    return Gemma4ForCausalLM(Gemma4TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, global_head_dim=8, hidden_size_per_layer_input=0, enable_moe_block=True,
        num_experts=8, top_k_experts=top_k, moe_intermediate_size=16, layer_types=["sliding_attention"] * 2,
        sliding_window=4))


def _dbrx(top_k: int):
    from transformers import DbrxConfig, DbrxForCausalLM

    return DbrxForCausalLM(DbrxConfig(
        d_model=32, n_heads=4, n_layers=2, max_seq_len=16, vocab_size=64,
        attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        ffn_config={"ffn_hidden_size": 16, "moe_num_experts": 8, "moe_top_k": top_k}))


@pytest.mark.parametrize("build", [_gemma4, _dbrx], ids=["gemma4", "dbrx"])
def test_topk_override_reaches_families_that_keep_k_elsewhere(build):
    """Gemma 4's routers read ``config.top_k_experts``, DBRX routes in its FFN block: evaluating at
    k' = 3 gives exactly the model built with top-3 (the same weights), and everything is restored."""
    import torch

    torch.manual_seed(0)
    model, built_at_3 = build(2).eval(), build(3).eval()
    built_at_3.load_state_dict(model.state_dict())
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        base = model(ids).logits
        with topk_override(model, 3) as changed:
            assert len(changed) == 2
            assert torch.equal(model(ids).logits, built_at_3(ids).logits)
        assert torch.equal(model(ids).logits, base)


def test_topk_override_restores_on_error_and_checks_range():
    import torch
    from transformers import AutoModelForCausalLM, OlmoeConfig

    model = AutoModelForCausalLM.from_config(
        OlmoeConfig(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
        )
    )
    with pytest.raises(RuntimeError, match="boom"), topk_override(model, 3):
        raise RuntimeError("boom")
    assert [r.top_k for _, r in find_routers(model)] == [2] and model.config.num_experts_per_tok == 2
    with pytest.raises(ValueError, match=r"--topk 5 is invalid for router 'model.layers.0.mlp.gate': it has 4 experts"):
        with topk_override(model, 5):
            pass
    dense = torch.nn.Linear(2, 2)
    with pytest.raises(NotAMoEError, match="no router with an integer `top_k`"), topk_override(dense, 1):
        pass


# ------------------------------------------------------------------------------- end to end


def _loglikelihoods(run_dir: Path) -> list[float]:
    lines = (run_dir / "samples" / "tiny_mc_0shot.jsonl").read_text().splitlines()
    return [resp[0][0] for line in lines for resp in json.loads(line)["resps"]]


def test_eval_topk_1_and_3_differ_and_merge(tiny_olmoe, tmp_path, capsys):
    runs = {}
    for k in (1, 3):
        out = tmp_path / f"top{k}"
        code, stdout, stderr = _eval(
            capsys, tiny_olmoe, "--suite", TINY_SUITE, "--topk", k, "--out", out, "--log-samples"
        )
        assert code == 0, stderr
        assert f"top-k {k} (override; native 2)" in stdout and "TinyCode" in stdout and "skipped" in stdout
        assert f"wrote {out / 'summary.json'}" in stdout
        runs[k] = out
        summary = json.loads((out / "summary.json").read_text())
        assert summary["topk"] == k and summary["topk_native"] == 2 and summary["routers"] == 2
        assert summary["average_label"] == "Avg(2 of 3)" and list(summary["skipped"]) == ["TinyCode"]
        assert summary["average_over"] == ["TinyMC", "TinyCloze"]
        assert summary["average"] == pytest.approx((summary["scores"]["TinyMC"] + summary["scores"]["TinyCloze"]) / 2)
        assert sorted(p.name for p in (out / "raw").iterdir()) == ["0shot.json"]  # one harness call per shots
        raw = json.loads((out / "raw" / "0shot.json").read_text())
        assert raw["results"]["tiny_mc"]["acc,none"] * 100 == pytest.approx(summary["scores"]["TinyMC"])
        assert next(t for t in summary["tasks"] if t["name"] == "TinyMC")["n_docs"] == 6
        header, row = list(csv.reader(io.StringIO((out / "summary.csv").read_text())))
        assert header[:7] == ["run", "suite", "checkpoint", "backend", "topk", "topk_native", "limit"]
        assert row[0] == f"top{k}" and row[4] == str(k) and row[header.index("TinyCode")] == ""
        assert row[header.index("average_over")] == "2/3"

    one, three = (json.loads((runs[k] / "summary.json").read_text()) for k in (1, 3))
    assert one["scores"]["TinyCloze PPL"] != pytest.approx(three["scores"]["TinyCloze PPL"], rel=1e-3)
    ll1, ll3 = _loglikelihoods(runs[1]), _loglikelihoods(runs[3])
    assert len(ll1) == len(ll3) == 18 and all(abs(a - b) > 1e-4 for a, b in zip(ll1, ll3))

    table = tmp_path / "table"
    assert main(["eval-table", str(runs[1]), str(runs[3]), "--out", str(table)]) == 0
    stdout = capsys.readouterr().out
    markdown = (tmp_path / "table.md").read_text()
    assert stdout.startswith(markdown) and f"wrote {table}.md and {table}.csv" in stdout
    ppl1, ppl3 = (format_score(s["scores"]["TinyCloze PPL"], 2) for s in (one, three))
    assert markdown.splitlines()[0] == "| Run | top-k | TinyMC | TinyCloze PPL ↓ | TinyCloze | TinyCode | Avg(3) | Δ |"
    assert markdown.splitlines()[2].startswith(f"| top1 | 1 | {one['scores']['TinyMC']:.2f} | {ppl1} |")
    assert markdown.splitlines()[3].startswith(f"| top3 | 3 | {three['scores']['TinyMC']:.2f} | {ppl3} |")
    assert "| skipped |" in markdown and "† top1: Avg(2 of 3), skipped: TinyCode." in markdown
    rows = list(csv.DictReader(io.StringIO((tmp_path / "table.csv").read_text())))
    assert [(r["run"], r["topk"]) for r in rows] == [("top1", "1"), ("top3", "3")]
    expected = round(round(three["scores"]["TinyCloze PPL"], 2) - round(one["scores"]["TinyCloze PPL"], 2), 2)
    assert float(rows[1]["delta TinyCloze PPL"]) == pytest.approx(expected)
    # both runs skipped TinyCode, so their averages cover the same tasks and are compared
    assert rows[1]["delta average"] == f"{round(three['average'], 2) - round(one['average'], 2):.2f}"


def test_code_execution_is_opt_in_with_a_warning(tiny_olmoe, tmp_path, capsys):
    code, stdout, stderr = _eval(
        capsys,
        tiny_olmoe,
        "--suite",
        TINY_SUITE,
        "--out",
        tmp_path / "run",
        "--allow-code-execution",
        "--name",
        "with-code",
    )
    assert code == 0, stderr
    assert "WARNING: --allow-code-execution" in stderr and "without a sandbox" in stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["run"] == "with-code" and summary["topk"] is None and summary["skipped"] == {}
    assert summary["average_label"] == "Avg(3)" and summary["average_complete"]
    assert next(t for t in summary["tasks"] if t["name"] == "TinyCode")["n_shot"] == 1  # the suite's shots
    assert "top-k 2 (native)" in stdout
    code, _, stderr = _eval(capsys, tiny_olmoe, "--suite", TINY_SUITE, "--out", tmp_path / "run")
    assert code == 2 and "summary.json exists; pass --overwrite" in stderr


# ------------------------------------------------------------------------------------ errors


def test_missing_lm_eval_names_the_extra(tiny_olmoe, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` now raises ImportError
    code, _, stderr = _eval(capsys, tiny_olmoe, "--suite", "avg9", "--out", tmp_path / "x")
    assert code == 2
    assert "needs lm-evaluation-harness" in stderr and "pip install 'elastic-moe-plugin[eval]'" in stderr
    assert not (tmp_path / "x").exists()


def test_unknown_task_and_metric_are_named_before_loading(tiny_olmoe, tmp_path, capsys):
    suite = tmp_path / "suite.yaml"
    tasks = FIXTURES / "tasks"
    suite.write_text(
        f"name: s\ninclude_path: {tasks}\ninclude_defaults: false\ntasks:\n"
        "  - {name: Q, task: tiny_mcq, metric: acc, num_fewshot: 0, why: a typo}\n"
    )
    code, _, stderr = _eval(capsys, tiny_olmoe, "--suite", suite, "--out", tmp_path / "x")
    assert code == 2
    assert "task 'Q' names lm-eval task 'tiny_mcq', which lm-eval" in stderr and "close matches: tiny_mc" in stderr
    suite.write_text(suite.read_text().replace("tiny_mcq, metric: acc", "tiny_mc, metric: accuracy"))
    code, _, stderr = _eval(capsys, tiny_olmoe, "--suite", suite, "--out", tmp_path / "x")
    assert (
        code == 2
        and "reads metric key 'accuracy,none' from lm-eval task 'tiny_mc', which declares only acc,none, acc_norm,none"
        in stderr
    )


def test_dense_checkpoint_is_refused(tmp_path, capsys):
    dense = _builder().build_model(tmp_path / "llama", "llama")
    code, _, stderr = _eval(capsys, dense, "--suite", TINY_SUITE, "--out", tmp_path / "x")
    assert code == 2
    assert "is not a mixture-of-experts model" in stderr and "model_type='llama'" in stderr


def test_topk_beyond_the_experts_is_refused(tiny_olmoe, tmp_path, capsys):
    code, _, stderr = _eval(capsys, tiny_olmoe, "--suite", TINY_SUITE, "--topk", 9, "--out", tmp_path / "x")
    assert code == 2 and "--topk 9 is invalid" in stderr and "has 8 experts per layer" in stderr


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed")
def test_vllm_backend_without_vllm(tiny_olmoe, tmp_path, capsys):
    code, _, stderr = _eval(capsys, tiny_olmoe, "--suite", TINY_SUITE, "--backend", "vllm", "--out", tmp_path / "x")
    assert code == 2 and "--backend vllm needs vLLM, which is not installed" in stderr

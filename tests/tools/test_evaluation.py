"""Evaluation suites, aggregation and the table merge, checked against the paper's printed numbers.

No model runs here (see test_evaluation_e2e.py for that). What is pinned:

- the suite files: valid, every choice has a reason, every harness task and metric key exists in
  the installed lm-eval's task registry (indexing YAML only, no download);
- aggregation: Avg(9) from Table 1's per-task numbers gives the printed 31.41 / 30.57 (OLMoE
  6–10 / top-8) and 58.44 / 56.42 (Qwen3); the pretraining average excludes perplexity and gives
  42.9 / 41.3 (Table 2);
- the task-size claims in the suites' ``why``: every printed score is k / n_docs;
- the table merge: Table 1's gains (+0.84, +2.02, ...) as differences of printed values,
  markdown and CSV content, partial averages;
- suite validation errors.
"""

from __future__ import annotations

import csv
import io

import pytest

from elastic_moe_plugin.tools.eval import (
    SuiteError,
    build_summary,
    builtin_suites,
    check_suite_tasks,
    load_suite,
    summarize,
)
from elastic_moe_plugin.tools.eval.table import TableError, merge, to_csv, to_markdown

pytestmark = pytest.mark.hf

AVG9 = ("MMLU", "AGIEval", "GPQA", "BBH", "GSM8K", "MATH", "MBPP", "IFEval", "TruthfulQA")

#: Table 1 of the paper (§4.2), per task in AVG9 order, and the printed Avg(9).
TABLE1 = {
    "OLMoE 6–10": ([51.25, 23.96, 26.34, 35.28, 21.46, 6.44, 25.40, 51.02, 41.58], 31.41),
    "OLMoE 5–11": ([50.91, 23.44, 26.79, 36.05, 21.38, 6.42, 25.00, 48.98, 41.15], 31.12),
    "OLMoE 7–9": ([50.14, 22.48, 26.12, 34.54, 19.86, 6.52, 25.60, 50.46, 41.60], 30.81),
    "OLMoE top-8": ([50.47, 23.29, 25.00, 34.86, 20.09, 6.40, 24.20, 50.46, 40.32], 30.57),
    "Qwen3 6–10": ([78.49, 52.28, 39.06, 63.29, 82.03, 42.36, 74.00, 42.51, 51.93], 58.44),
    "Qwen3 5–11": ([78.40, 51.90, 38.39, 57.69, 82.94, 37.78, 76.00, 43.44, 52.65], 57.69),
    "Qwen3 7–9": ([78.17, 52.44, 37.28, 55.68, 82.71, 42.18, 73.40, 40.48, 52.28], 57.18),
    "Qwen3 top-8": ([78.24, 51.74, 37.72, 49.29, 81.43, 41.24, 73.80, 41.22, 53.14], 56.42),
}
#: Tables 3, A.4 and A.5 (OLMoE): more printed per-task scores for the task-size check.
MORE_OLMOE_ROWS = [
    [50.56, 24.17, 27.68, 35.11, 21.91, 6.16, 26.00, 50.09, 41.81],  # L3–L7 only
    [50.90, 23.39, 28.12, 34.77, 18.65, 6.26, 25.60, 49.72, 41.00],  # L8–L12 only
    [50.65, 23.62, 27.90, 35.68, 19.79, 6.30, 27.60, 49.35, 40.85],  # sigma = 1.0
    [50.65, 23.31, 27.68, 35.23, 19.26, 5.70, 25.00, 47.69, 41.41],  # sigma = 3.0
    [50.06, 23.44, 27.90, 34.00, 17.29, 4.72, 24.80, 45.10, 40.21],  # top-p -> top-8
    [50.06, 23.44, 27.90, 34.00, 17.29, 4.72, 24.80, 44.92, 40.21],  # top-p -> top-p
    [50.66, 23.36, 26.34, 33.71, 19.33, 6.22, 25.00, 50.28, 41.46],  # top-9
    [50.25, 23.29, 26.12, 35.16, 20.32, 7.04, 25.40, 49.54, 40.19],  # top-10
]
PRETRAIN = (
    "LAMBADA PPL",
    "LAMBADA",
    "HellaSwag",
    "PIQA",
    "WinoGrande",
    "CommonsenseQA",
    "SciQ",
    "OpenBookQA",
    "ARC-Easy",
    "ARC-Challenge",
    "MMLU",
    "LogiQA",
)
#: Table 2 of the paper (§4.3), per task in PRETRAIN order, and the printed average (excl. PPL).
TABLE2 = {
    "top-8": ([54.2, 31.3, 41.9, 68.4, 49.3, 19.4, 81.4, 31.0, 53.7, 28.5, 23.1, 26.3], 41.3),
    "6–10": ([42.7, 33.1, 43.7, 68.6, 52.6, 20.1, 82.0, 33.8, 55.1, 29.9, 26.1, 27.2], 42.9),
    "7–9": ([44.9, 32.2, 43.5, 68.3, 53.0, 19.8, 82.2, 35.2, 55.3, 31.1, 24.1, 26.3], 42.8),
}


def harness_results(suite, scores: dict[str, float]) -> dict:
    """What lm-eval would return for these printed scores: ``(task, shots) -> {"results": ...}``."""
    runs: dict = {}
    for task in suite.tasks:
        if task.name not in scores:
            continue
        value = scores[task.name] / 100 if task.percent else scores[task.name]
        run = runs.setdefault(task.run_key, {"results": {}, "n-shot": {task.task: task.num_fewshot}})
        run["results"].setdefault(task.task, {})[task.metric_key] = value
    return runs


def paper_summary(suite, run: str, values: list[float], names, **kwargs) -> dict:
    scores = dict(zip(names, values, strict=True))
    return build_summary(
        suite, harness_results(suite, scores), run=run, checkpoint=f"ckpt/{run}", topk_native=8, **kwargs
    )


# ------------------------------------------------------------------------------------ suites


def test_builtin_suites_hold_the_papers_tasks():
    assert builtin_suites() == ["avg9", "pretrain11"]
    avg9 = load_suite("avg9")
    assert tuple(t.name for t in avg9.tasks) == AVG9 and avg9.average_label == "Avg(9)"
    assert [t.task for t in avg9.tasks] == [
        "mmlu",
        "agieval_en",
        "gpqa_main_zeroshot",
        "bbh",
        "gsm8k",
        "minerva_math",
        "mbpp",
        "ifeval",
        "truthfulqa_mc2",
    ]
    assert [t.name for t in avg9.tasks if t.code_execution] == ["MBPP"]
    assert not avg9.apply_chat_template
    pretrain = load_suite("pretrain11")
    assert tuple(t.name for t in pretrain.tasks) == PRETRAIN
    assert [t.name for t in pretrain.averaged] == list(PRETRAIN[1:])  # 11 accuracies, PPL reported apart
    assert pretrain.runs()[("lambada_openai", 0)] == [pretrain.tasks[0], pretrain.tasks[1]]  # one harness run
    assert all(t.num_fewshot == 0 for t in pretrain.tasks)
    for suite in (avg9, pretrain):
        assert all(len(t.why) > 40 for t in suite.tasks), "every choice carries its reason"


@pytest.fixture(scope="module")
def registry():
    """lm-eval's full task index: it reads the bundled task YAMLs, downloads nothing."""
    pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    return TaskManager()


@pytest.mark.parametrize("name", ["avg9", "pretrain11"])
def test_suite_tasks_and_metric_keys_exist_in_lm_eval(registry, name):
    check_suite_tasks(load_suite(name), registry)  # raises UnknownTaskError otherwise


def test_printed_scores_are_counts_over_the_chosen_task_sizes():
    """The `n_docs` behind each `why`: every printed Table 1/3/A.4/A.5 score is k/n_docs (TruthfulQA
    MC2 is an average of probabilities, so it has no such grid)."""
    sizes = {t.name: t.n_docs for t in load_suite("avg9").tasks}
    rows = [values for values, _ in TABLE1.values()] + MORE_OLMOE_ROWS
    for row in rows:
        for name, printed in zip(AVG9, row, strict=True):
            if name == "TruthfulQA":
                continue
            n = sizes[name]
            k = round(printed * n / 100)
            assert any(round(100 * j / n, 2) == printed for j in (k - 1, k, k + 1)), (name, printed, n)
    # ... and the alternatives the suites reject do not fit: IFEval per instruction (834),
    # MATH-500, GPQA Diamond (198), MBPP sanitized (257).
    for name, n in [("IFEval", 834), ("MATH", 500), ("GPQA", 198), ("MBPP", 257)]:
        column = [row[AVG9.index(name)] for row in rows]
        assert not all(any(round(100 * j / n, 2) == v for j in range(n + 1)) for v in column), (name, n)


# ------------------------------------------------------------------------------- aggregation


@pytest.mark.parametrize("run", list(TABLE1))
def test_avg9_reproduces_table1(run):
    values, printed = TABLE1[run]
    summary = summarize(load_suite("avg9"), harness_results(load_suite("avg9"), dict(zip(AVG9, values))))
    assert f"{summary['average']:.2f}" == f"{printed:.2f}"
    assert summary["average_label"] == "Avg(9)" and summary["average_complete"]
    assert summary["scores"]["GSM8K"] == pytest.approx(values[AVG9.index("GSM8K")])


def test_avg9_headline_values():
    suite = load_suite("avg9")
    averages = {
        run: summarize(suite, harness_results(suite, dict(zip(AVG9, v))))["average"] for run, (v, _) in TABLE1.items()
    }
    assert [round(averages[r], 2) for r in ("OLMoE 6–10", "OLMoE top-8", "Qwen3 6–10", "Qwen3 top-8")] == [
        31.41,
        30.57,
        58.44,
        56.42,
    ]


@pytest.mark.parametrize("run", list(TABLE2))
def test_pretrain_average_excludes_perplexity(run):
    values, printed = TABLE2[run]
    suite = load_suite("pretrain11")
    summary = summarize(suite, harness_results(suite, dict(zip(PRETRAIN, values))))
    assert f"{summary['average']:.1f}" == f"{printed:.1f}"
    assert summary["average_over"] == list(PRETRAIN[1:])
    assert summary["scores"]["LAMBADA PPL"] == pytest.approx(values[0])  # as is, not x100


def test_pretrain_headline_values():
    suite = load_suite("pretrain11")
    got = [
        summarize(suite, harness_results(suite, dict(zip(PRETRAIN, TABLE2[r][0]))))["average"]
        for r in ("6–10", "top-8")
    ]
    assert [round(a, 1) for a in got] == [42.9, 41.3]
    top8 = TABLE2["top-8"][0]
    assert round(sum(top8) / len(top8), 1) == 42.4  # what averaging the perplexity in would print


def test_skipped_mbpp_makes_the_average_over_eight():
    suite = load_suite("avg9")
    values, _ = TABLE1["OLMoE 6–10"]
    scores = {name: v for name, v in zip(AVG9, values) if name != "MBPP"}
    summary = summarize(suite, harness_results(suite, scores), skipped={"MBPP": "needs --allow-code-execution"})
    assert summary["average_label"] == "Avg(8 of 9)" and not summary["average_complete"]
    assert summary["average"] == pytest.approx(sum(scores.values()) / 8)
    assert summary["skipped"] == {"MBPP": "needs --allow-code-execution"}
    assert "over 8 of 9 tasks" in summary["notes"][0] and "MBPP" in summary["notes"][0]
    assert next(t for t in summary["tasks"] if t["name"] == "MBPP")["score"] is None


def test_missing_metric_key_is_a_clear_error():
    from elastic_moe_plugin.tools.eval import EvaluationError

    suite = load_suite("avg9")
    runs = harness_results(suite, dict(zip(AVG9, TABLE1["OLMoE 6–10"][0])))
    runs[("gsm8k", 5)]["results"]["gsm8k"] = {"exact_match,strict-match": 0.2}
    with pytest.raises(EvaluationError, match=r"no 'exact_match,flexible-extract'.*exact_match,strict-match"):
        summarize(suite, runs)


def test_shots_and_document_counts_are_checked():
    suite = load_suite("avg9")
    runs = harness_results(suite, dict(zip(AVG9, TABLE1["OLMoE 6–10"][0])))
    runs[("mmlu", 5)]["group_subtasks"] = {"mmlu": ["mmlu_stem"], "mmlu_stem": ["mmlu_anatomy", "mmlu_astronomy"]}
    runs[("mmlu", 5)]["n-shot"] = {"mmlu_anatomy": 0, "mmlu_astronomy": 0, "gsm8k": 5}  # gsm8k: same call
    runs[("mmlu", 5)]["n-samples"] = {
        leaf: {"original": 100, "effective": 100} for leaf in ("mmlu_anatomy", "mmlu_astronomy")
    }
    runs[("gpqa_main_zeroshot", 0)]["n-samples"] = {"gpqa_main_zeroshot": {"original": 198, "effective": 198}}
    notes = summarize(suite, runs)["notes"]
    assert any("MMLU: asked for 5-shot, the harness ran 0-shot" in note for note in notes)
    assert any("GPQA: scored 198 documents, the suite expects 448" in note for note in notes)
    assert any("MMLU: scored 200 documents, the suite expects 14042" in note for note in notes)
    assert not any(note.startswith("GSM8K") for note in notes)


# ------------------------------------------------------------------------------------- table


def table1(backbone: str, **kwargs):
    suite = load_suite("avg9")
    runs = [r for r in TABLE1 if r.startswith(backbone)]
    summaries = [paper_summary(suite, r, TABLE1[r][0], AVG9) for r in runs]
    return merge(summaries, baseline=f"{backbone} top-8", **kwargs)


def test_table_reproduces_table1_gains():
    olmoe, qwen = table1("OLMoE"), table1("Qwen3")
    gains = {t.rows[i]["run"]: t.average_delta(i) for t in (olmoe, qwen) for i in range(len(t.rows))}
    assert gains == {
        "OLMoE 6–10": 0.84,
        "OLMoE 5–11": 0.55,
        "OLMoE 7–9": 0.24,
        "OLMoE top-8": 0.0,
        "Qwen3 6–10": 2.02,
        "Qwen3 5–11": 1.27,
        "Qwen3 7–9": 0.76,
        "Qwen3 top-8": 0.0,
    }
    # the BBH jump that carries most of the Qwen3 gain (Table 1 of the paper)
    assert qwen.delta(0, "BBH") == 14.0


def test_table_markdown_and_csv():
    table = table1("OLMoE")
    markdown = to_markdown(table)
    lines = markdown.splitlines()
    assert (
        lines[0]
        == "| Run | top-k | MMLU | AGIEval | GPQA | BBH | GSM8K | MATH | MBPP | IFEval | TruthfulQA | Avg(9) | Δ |"
    )
    assert (
        "| OLMoE 6–10 | 8 | 51.25 | 23.96 | 26.34 | 35.28 | 21.46 | 6.44 | 25.40 | 51.02 | 41.58 | 31.41 | +0.84 |"
        in lines
    )
    assert (
        "| OLMoE top-8 | 8 | 50.47 | 23.29 | 25.00 | 34.86 | 20.09 | 6.40 | 24.20 | 50.46 | 40.32 | 30.57 | – |"
        in lines
    )
    assert "Δ vs OLMoE top-8 (printed values subtracted):" in lines
    assert "| OLMoE 6–10 | +0.78 | +0.67 | +1.34 | +0.42 | +1.37 | +0.04 | +1.20 | +0.56 | +1.26 | +0.84 |" in lines
    rows = list(csv.DictReader(io.StringIO(to_csv(table))))
    assert [r["run"] for r in rows] == ["OLMoE 6–10", "OLMoE 5–11", "OLMoE 7–9", "OLMoE top-8"]
    assert rows[0]["MMLU"] == "51.25" and rows[0]["average"] == "31.41" and rows[0]["delta average"] == "0.84"
    assert rows[0]["delta GPQA"] == "1.34" and rows[3]["delta average"] == "0.00"
    assert rows[1]["average_over"] == "9/9"


def test_table_pretraining_suite_marks_perplexity():
    suite = load_suite("pretrain11")
    summaries = [paper_summary(suite, r, TABLE2[r][0], PRETRAIN) for r in TABLE2]
    markdown = to_markdown(merge(summaries, baseline="top-8"))
    assert "| Run | top-k | LAMBADA PPL ↓ | LAMBADA |" in markdown
    assert (
        "| 6–10 | 8 | 42.7 | 33.1 | 43.7 | 68.6 | 52.6 | 20.1 | 82.0 | 33.8 | 55.1 | 29.9 | 26.1 | 27.2 | 42.9 | +1.6 |"
        in markdown
    )
    assert "| 6–10 | -11.5 | +1.8 |" in markdown
    assert "Not in the average: LAMBADA PPL. ↓: lower is better." in markdown


def test_table_flags_partial_averages():
    suite = load_suite("avg9")
    values, _ = TABLE1["OLMoE 6–10"]
    scores = {n: v for n, v in zip(AVG9, values) if n != "MBPP"}
    partial = build_summary(
        suite,
        harness_results(suite, scores),
        run="no-mbpp",
        checkpoint="c",
        topk_native=8,
        skipped={"MBPP": "needs --allow-code-execution"},
    )
    full = paper_summary(suite, "full", TABLE1["OLMoE top-8"][0], AVG9)
    table = merge([full, partial])
    markdown = to_markdown(table)
    assert f"| {partial['average']:.2f}† | n/c |" in markdown and "| skipped |" in markdown
    assert "† no-mbpp: Avg(8 of 9), skipped: MBPP." in markdown
    assert table.average_delta(1) is None and table.delta(1, "MBPP") is None and table.delta(1, "MMLU") == 0.78


def test_table_errors():
    suite = load_suite("avg9")
    a = paper_summary(suite, "a", TABLE1["OLMoE top-8"][0], AVG9)
    b = paper_summary(load_suite("pretrain11"), "b", TABLE2["top-8"][0], PRETRAIN)
    with pytest.raises(TableError, match="different suites"):
        merge([a, b])
    with pytest.raises(TableError, match="repeated: a"):
        merge([a, a])
    with pytest.raises(TableError, match="--baseline 'c' is not one of the runs: a"):
        merge([a], baseline="c")


# -------------------------------------------------------------------------- suite validation


def write_suite(tmp_path, body: str):
    path = tmp_path / "suite.yaml"
    path.write_text(body)
    return path


GOOD_TASK = "  - {name: A, task: arc_easy, metric: acc, num_fewshot: 0, why: a reason}\n"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("name: s\ntask:\n" + GOOD_TASK, r"unknown key 'task'; did you mean 'tasks'\?"),
        (
            "name: s\ntasks:\n  - {name: A, task: x, metric: acc, num_fewshot: 0, wyh: r}\n",
            r"tasks\[0\] \(A\): unknown key 'wyh'; did you mean 'why'\?",
        ),
        ("name: s\ntasks:\n  - {name: A, task: x, metric: acc, num_fewshot: 0}\n", "missing required key 'why'"),
        (
            "name: s\ntasks:\n  - {name: A, task: x, metric: acc, num_fewshot: -1, why: r}\n",
            "num_fewshot=-1 is invalid",
        ),
        ("name: s\ntasks:\n" + GOOD_TASK * 2, "repeated: A"),
        (
            "name: s\ntasks:\n  - {name: A, task: x, metric: ppl, num_fewshot: 0, in_average: false, why: r}\n",
            "nothing to average",
        ),
        ("name: s\ninclude_path: nowhere\ntasks:\n" + GOOD_TASK, "include_path folder .*nowhere.* does not exist"),
    ],
)
def test_suite_errors(tmp_path, body, message):
    with pytest.raises(SuiteError, match=message):
        load_suite(write_suite(tmp_path, body))


def test_task_requirements_name_the_lm_eval_extra(monkeypatch):
    from elastic_moe_plugin.tools.eval import harness as evaluation

    absent = {"langdetect", "math_verify"}  # pretend everything else is installed
    monkeypatch.setattr(
        evaluation.importlib.util, "find_spec", lambda name, package=None: None if name in absent else name
    )
    evaluation.check_task_requirements(["mmlu", "gsm8k"])  # nothing extra needed
    with pytest.raises(
        evaluation.MissingExtraError, match=r"langdetect \(ifeval\), math_verify \(minerva_math\)"
    ) as error:
        evaluation.check_task_requirements(["ifeval", "minerva_math"])
    assert "pip install 'lm_eval[ifeval,math]>=0.4.9'" in str(error.value)


def test_unknown_suite_name_suggests_builtin():
    with pytest.raises(SuiteError, match=r"did you mean 'avg9'\?.*avg9, pretrain11"):
        load_suite("avg8")

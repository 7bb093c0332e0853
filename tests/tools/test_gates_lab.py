"""The gate-convention lab: compare, zero-gradient causes, boundary-aware gradcheck, the two-logit
example and the ``elastic-moe gates`` hooks."""

import argparse
import json
import math

import numpy
import pytest
import torch

from elastic_moe_plugin.cli import gates as gates_cli
from elastic_moe_plugin.tools.gates_lab.conventions import get_convention
from elastic_moe_plugin.tools.gates_lab import (
    compare,
    gradcheck_router,
    load_logits,
    two_logit_example,
)
from elastic_moe_plugin.tools.gates_lab import toy_moe

F64 = torch.float64


# ----------------------------------------------------------------------------------------- compare
def _reference_run(k, seed=0, tokens=16, experts=8, hidden=8, renormalise=False):
    """The toy MoE written as a per-token loop with plain torch ops (no gates module), drawn in the
    lab's documented order from one generator seeded with ``seed``: inputs [T, D], router [E, D] / √D,
    experts [E, D, D] / √D, targets [T, D]."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(tokens, hidden, generator=generator, dtype=F64)
    router = (torch.randn(experts, hidden, generator=generator, dtype=F64) / math.sqrt(hidden)).requires_grad_()
    expert_weight = torch.randn(experts, hidden, hidden, generator=generator, dtype=F64) / math.sqrt(hidden)
    targets = torch.randn(tokens, hidden, generator=generator, dtype=F64)
    outputs = []
    for t in range(tokens):
        logits = inputs[t] @ router.T
        probs = torch.exp(logits) / torch.exp(logits).sum()
        top = sorted(range(experts), key=lambda e: -logits[e].item())[:k]
        weights = [probs[e] / (sum(probs[j] for j in top) if renormalise else 1) for e in top]
        outputs.append(sum(w * (expert_weight[e] @ inputs[t]) for w, e in zip(weights, top)))
    loss = 0.5 * torch.stack([((y - targets[t]) ** 2).sum() for t, y in enumerate(outputs)]).mean()
    loss.backward()
    return loss.item(), router.grad.norm().item()


def test_compare_matches_a_hand_written_toy_and_shares_everything_but_the_gate():
    report = compare(k=2)
    setup, results = report["setup"], report["conventions"]
    assert list(results) == ["full_softmax", "renormalized", "selected_softmax", "sigmoid"]
    loss, router_norm = _reference_run(2)
    assert results["full_softmax"]["loss"] == pytest.approx(loss, rel=1e-12)
    assert results["full_softmax"]["router_grad_norm"] == pytest.approx(router_norm, rel=1e-10)
    loss, router_norm = _reference_run(2, renormalise=True)
    assert results["renormalized"]["loss"] == pytest.approx(loss, rel=1e-12)
    assert results["renormalized"]["router_grad_norm"] == pytest.approx(router_norm, rel=1e-10)
    assert results["selected_softmax"]["loss"] == pytest.approx(loss, rel=1e-12)
    # Same logits: the same experts everywhere, and the recorded sums follow each convention.
    assert report["same_selection"] and setup["budgets"] == [2] * 16
    assert all(len([i for i in row if i >= 0]) == 2 for row in results["sigmoid"]["selected"])
    assert results["renormalized"]["retained_weight_sum"] == pytest.approx({"mean": 1.0, "min": 1.0, "max": 1.0})
    assert 0 < results["full_softmax"]["retained_weight_sum"]["max"] < 1
    # Experts no token selected get no gradient, under every convention.
    chosen = {i for row in results["full_softmax"]["selected"] for i in row}
    for result in results.values():
        assert all((norm == 0) == (e not in chosen) for e, norm in enumerate(result["expert_grad_norm"]))


def test_renormalised_top1_zeros_are_explained():
    report = compare(k=1)
    results = report["conventions"]
    for name in ("renormalized", "selected_softmax"):
        assert results[name]["zero_gate_grad_tokens"] == 16
        assert results[name]["zero_causes"] == {"renormalized_top1": 16}
        assert results[name]["router_grad_norm"] == 0.0
        assert results[name]["unselected_logit_grad_tokens"] == 0
    # Full softmax: every token's router gets gradient, including through unselected logits.
    assert results["full_softmax"]["zero_gate_grad_tokens"] == 0
    assert results["full_softmax"]["unselected_logit_grad_tokens"] == 16
    assert results["sigmoid"]["zero_gate_grad_tokens"] == 0
    assert "renormalized_top1" in report["causes"] and "p_a / p_a = 1" in report["causes"]["renormalized_top1"]


def test_identical_expert_outputs_are_detected():
    results = compare(k=2, identical_experts=True)["conventions"]
    for name in ("renormalized", "selected_softmax", "sigmoid"):
        assert results[name]["zero_causes"] == {"identical_outputs": 16}, name
    assert results["full_softmax"]["zero_gate_grad_tokens"] == 0  # Σ_S p still depends on the logits


def test_elastic_budgets_mix_causes_per_token():
    report = compare(k=2, schedule="1-3", identical_experts=True, seed=3)
    budgets = report["setup"]["budgets"]
    assert set(budgets) <= {1, 2, 3} and len(set(budgets)) > 1 and report["setup"]["width"] == 3
    for row, budget in zip(report["conventions"]["renormalized"]["selected"], budgets):
        assert len([i for i in row if i >= 0]) == budget
    causes = {z["token"]: z["cause"] for z in report["conventions"]["renormalized"]["zero_gate_grad"]}
    assert causes == {t: "renormalized_top1" if b == 1 else "identical_outputs" for t, b in enumerate(budgets)}
    # sigmoid keeps the raw score at κ = 1, so only its κ > 1 tokens are zero.
    sigmoid_zero = {z["token"] for z in report["conventions"]["sigmoid"]["zero_gate_grad"]}
    assert sigmoid_zero == {t for t, b in enumerate(budgets) if b > 1}


def test_saturated_and_detached_causes():
    logits = torch.tensor([[0.0, 1000.0, -3.0, 1.0], [2.0, -1.0, 0.5, 0.0]], dtype=F64)
    results = compare(k=1, logits=logits)["conventions"]
    full = results["full_softmax"]
    assert [z["token"] for z in full["zero_gate_grad"]] == [0]
    assert full["zero_causes"] == {"saturated": 1} and full["router_grad_norm"] is None
    assert results["sigmoid"]["zero_causes"] == {"saturated": 1}  # σ(1000) == 1.0 exactly
    detached = compare(k=2, detach_gate=True)
    for result in detached["conventions"].values():
        assert result["zero_causes"] == {"detached": 16} and result["router_grad_norm"] == 0.0
        assert sum(result["expert_grad_norm"]) > 0  # the experts still learn
    assert "detached" in detached["causes"]


def test_zero_output_gradient_cause():
    # the unit test of the private toy_moe._zero_cause itself
    outputs = torch.randn(1, 3, 2, dtype=F64)
    cause = toy_moe._zero_cause(
        "full_softmax", 0, detached=False, kept=2, weights=torch.tensor([[0.5, 0.2]], dtype=F64),
        logits=torch.zeros(1, 3, dtype=F64), kept_ids=torch.tensor([0, 1]), expert_outputs=outputs,
        output_grad=torch.zeros(1, 2, dtype=F64),
    )
    assert cause == "zero_output_grad"


def test_compare_is_seeded():
    assert compare(k=2, schedule="1-3", seed=5) == compare(k=2, schedule="1-3", seed=5)
    losses = [compare(seed=seed)["conventions"]["full_softmax"]["loss"] for seed in (5, 6)]
    assert losses[0] != losses[1]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"k": 9}, r"--k=9 is invalid: expected 1 <= k <= --experts=8"),
        ({"conventions": "softmax"}, "expected one of full_softmax, renormalized"),
        ({"schedule": "1-5", "k": 2}, "not 2"),
        ({"schedule": "2-6", "k": 4, "num_experts": 5}, "only 5 experts"),
        ({"logits": torch.zeros(3, 4, dtype=F64), "num_experts": 5}, r"--experts=5 contradicts --logits"),
        ({"dtype": "float16"}, "--dtype='float16' is invalid"),
        ({"num_tokens": 0}, "--tokens=0 is invalid"),
    ],
)
def test_compare_rejects_bad_input(kwargs, message):
    with pytest.raises(ValueError, match=message):
        compare(**kwargs)


# --------------------------------------------------------------------------------------- gradcheck
WELL_SEPARATED = torch.tensor(
    [[3.0, 1.0, -1.0, 2.0, -2.5], [0.0, -1.5, 2.5, 1.0, -0.5], [-2.0, 0.5, 1.5, -1.0, 3.5]], dtype=F64
)


@pytest.mark.parametrize("name", ["full_softmax", "renormalized", "selected_softmax", "sigmoid"])
@pytest.mark.parametrize("k", [1, 2, torch.tensor([1, 3, 2])])
def test_gradcheck_passes_on_well_separated_logits(name, k):
    result = gradcheck_router(name, WELL_SEPARATED, k)
    assert result.status == "passed", result.message
    assert result.checked_tokens == [0, 1, 2] and result.refused == []
    assert result.step == 1e-6 and result.max_abs_error < 1e-8
    assert "passed on 3 token(s)" in result.message


def test_gradcheck_measures_the_membership_margin():
    result = gradcheck_router("full_softmax", WELL_SEPARATED, 2)
    # ranks 2 | 3: token 0 (2.0 vs 1.0), token 1 (1.0 vs 0.0), token 2 (1.5 vs 0.5)
    assert result.margins.tolist() == [1.0, 1.0, 1.0]
    assert result.rank_margins[0, :2].tolist() == [1.0, 1.0] and math.isnan(result.rank_margins[0, 2])
    assert gradcheck_router("full_softmax", WELL_SEPARATED[:1], 5).margins.tolist() == [math.inf]


def test_gradcheck_picks_a_step_below_the_smallest_margin():
    logits = torch.tensor([[1.0, 1.0 - 2e-6, -1.0], [0.0, 3.0, -1.0]], dtype=F64)
    result = gradcheck_router("full_softmax", logits, 1)
    assert result.status == "passed", result.message
    assert result.step == pytest.approx(0.25 * 2e-6, rel=1e-6)  # a quarter of the smallest margin
    assert gradcheck_router("full_softmax", logits[1:], 1).step == 1e-6  # capped at the default


def test_gradcheck_refuses_a_step_that_crosses_a_rank_change():
    logits = torch.tensor([[2.0, 1.0, 0.9995, -1.0], [3.0, 0.0, -2.0, 1.0]], dtype=F64)
    result = gradcheck_router("renormalized", logits, 2, step=1e-3)
    assert result.status == "refused"
    assert result.checked_tokens == [1] and torch.isnan(result.numeric[0]).all()
    assert not torch.isnan(result.numeric[1]).any()
    (change,) = result.refused
    assert (change.token, change.budget, change.left, change.entered, change.observed) == (0, 2, 1, 2, True)
    assert change.margin == pytest.approx(5e-4)
    assert "refused for 1 of 2 token(s)" in result.message
    assert "expert 2 enters and expert 1 leaves" in result.message and "is <= the step 0.001" in result.message


def test_gradcheck_at_a_boundary_reports_the_selection_change():
    # Explicit boundary test: the expected result is a selection change, not a derivative.
    logits = torch.tensor([[0.5, 2.0, 2.0 - 1e-10, -1.0]], dtype=F64)
    fixed = torch.tensor([[0.0, 1.0, -1.0, 0.0]], dtype=F64)
    result = gradcheck_router("full_softmax", logits, 1, expert_outputs=fixed)
    assert result.status == "refused" and result.checked_tokens == [] and result.step is None
    (change,) = result.refused
    assert (change.left, change.entered, change.observed) == (1, 2, True)
    # y jumps from p_1·F_1 to p_2·F_2 (p_1 ≈ p_2): a branch change, not a smooth difference.
    p = math.exp(2.0) / (math.exp(0.5) + 2 * math.exp(2.0) + math.exp(-1.0))
    assert change.output_jump == pytest.approx(-2 * p, rel=1e-4)
    assert "below the floor" in result.message


def test_gradcheck_refuses_an_exact_tie():
    result = gradcheck_router("selected_softmax", torch.tensor([[1.0, 0.0, 1.0]], dtype=F64), 1)
    (change,) = result.refused
    assert result.status == "refused" and change.margin == 0 and "is a tie" in change.describe()


def test_gradcheck_catches_a_wrong_gradient():
    def broken(logits, k, *, width=None):
        expert_ids, weights = get_convention("full_softmax")(logits, k, width=width)
        return expert_ids, weights.detach() + 0 * weights  # forward right, gradient 0: wrong
    result = gradcheck_router(broken, WELL_SEPARATED, 2)
    assert result.status == "failed" and "FAILED on token(s) [0, 1, 2]" in result.message


def test_gradcheck_rejects_bad_input():
    with pytest.raises(ValueError, match="--step=0 is invalid"):
        gradcheck_router("full_softmax", WELL_SEPARATED, 1, step=0)
    with pytest.raises(ValueError, match=r"expert_outputs must be \[tokens, experts\] = \[3, 5\]"):
        gradcheck_router("full_softmax", WELL_SEPARATED, 1, expert_outputs=torch.zeros(2, 5))
    with pytest.raises(ValueError, match="budgets k must lie in 1..num_experts=5"):
        gradcheck_router("full_softmax", WELL_SEPARATED, torch.tensor([1, 6, 2]))


def test_compare_gradcheck_uses_the_linearised_toy():
    report = compare(k=2, gradcheck=True)
    for result in report["conventions"].values():
        assert result["gradcheck"]["status"] == "passed", result["gradcheck"]["message"]


# --------------------------------------------------------------------------------- two-logit example
def test_two_logit_example_numbers():
    half = two_logit_example(x=0.5, w=1)
    assert half["logits"] == [0.0, 0.0] and half["tie"]
    assert half["p2"] == pytest.approx(0.5, abs=1e-15) and half["dp2_dz2"] == pytest.approx(0.25, abs=1e-15)
    one = two_logit_example(x=1, w=1)
    assert one["p2"] == pytest.approx(0.6224593312, abs=1e-10)
    assert one["dp2_dz2"] == pytest.approx(0.6224593312 * (1 - 0.6224593312), abs=1e-10)
    assert f"{one['p2']:.4f} {one['dp2_dz2']:.3f}" == "0.6225 0.235"
    assert one["dp2_dw"] == pytest.approx(one["dp2_dz2"]) and one["dp2_dx"] == pytest.approx(one["dp2_dz2"])
    assert two_logit_example(x=2, w=1)["dp2_dw"] == pytest.approx(2 * 0.8175744762 * (1 - 0.8175744762), abs=1e-10)
    top1 = one["top1"]
    assert top1["full_softmax"]["selected"] == 1
    assert top1["full_softmax"]["dweight_dz2"] == pytest.approx(0.2350037122, abs=1e-10)
    assert top1["full_softmax"]["dweight_dz1"] == pytest.approx(-0.2350037122, abs=1e-10)
    assert top1["renormalized"]["weight"] == 1.0
    assert top1["renormalized"]["dweight_dz1"] == 0.0 and top1["renormalized"]["dweight_dz2"] == 0.0


# ------------------------------------------------------------------------------------------- CLI
def _cli(argv, capsys):
    parser = argparse.ArgumentParser(prog="elastic-moe gates")
    gates_cli.configure_parser(parser)
    code = gates_cli.run(parser.parse_args(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_two_logit_prints_the_worked_numbers(capsys):
    code, out, _ = _cli(["--two-logit", "--x", "1", "--w", "1"], capsys)
    assert code == 0
    assert "p2 = sigmoid(w*x - 0.5)          = 0.622459" in out
    assert "dp2/dz2 = p2 * (1 - p2)          = 0.235004" in out
    assert "renormalized        1.000000   0.000000   0.000000" in out
    code, out, _ = _cli(["--two-logit", "--x", "0.5", "--w", "1", "--json"], capsys)
    assert code == 0 and json.loads(out)["dp2_dz2_closed"] == 0.25


def test_cli_table_and_json(capsys):
    code, out, _ = _cli([], capsys)
    assert code == 0
    assert "top-1 static" in out and "renormalized: 16 token(s): renormalized_top1 x16" in out
    assert "[renormalized_top1] renormalised top-1" in out
    argv = ["--k", "2", "--schedule", "1-3", "--tokens", "6", "--experts", "4", "--seed", "1", "--json"]
    code, out, _ = _cli(argv, capsys)
    report = json.loads(out)
    assert code == 0 and report["setup"]["schedule"] == "1-3" and len(report["setup"]["budgets"]) == 6
    assert len(report["conventions"]["sigmoid"]["expert_grad_norm"]) == 4


@pytest.mark.parametrize("suffix", [".pt", ".npy", ".json"])
def test_cli_reads_user_logits(tmp_path, capsys, suffix):
    logits = [[0.0, 2.0, -1.0], [1.0, 0.5, 3.0]]
    path = tmp_path / f"logits{suffix}"
    if suffix == ".pt":
        torch.save(torch.tensor(logits), path)
    elif suffix == ".npy":
        numpy.save(path, numpy.array(logits))
    else:
        path.write_text(json.dumps({"logits": logits}))
    assert load_logits(path).tolist() == logits
    code, out, _ = _cli(["--logits", str(path), "--json"], capsys)
    report = json.loads(out)
    assert code == 0 and report["conventions"]["full_softmax"]["selected"] == [[1], [2]]
    assert report["setup"]["router"] == f"user-supplied logits from {path}"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--x", "1"], "--x and --w set the two-logit example: add --two-logit"),
        (["--conventions", "renormalised"], "'renormalised' is unknown: expected one of full_softmax"),
        (["--k", "3", "--experts", "2"], "--k=3 is invalid"),
        (["--logits", "missing.pt"], "--logits 'missing.pt': no such file"),
        (["--schedule", "6-10", "--k", "8", "--experts", "8"], "only 8 experts"),
        (["--step", "-1", "--gradcheck"], "--step=-1.0 is invalid"),
    ],
)
def test_cli_errors_exit_2_with_a_message(argv, message, capsys):
    code, out, err = _cli(argv, capsys)
    assert code == 2 and out == ""
    assert err.startswith("elastic-moe gates: error: ") and message in err


def test_load_logits_rejects_bad_files(tmp_path):
    (tmp_path / "l.txt").write_text("1 2")
    with pytest.raises(ValueError, match=r"unsupported file type '.txt'; expected .pt/.pth, .npy or .json"):
        load_logits(tmp_path / "l.txt")
    (tmp_path / "nan.json").write_text("[[1, NaN]]")
    with pytest.raises(ValueError, match="must be finite"):
        load_logits(tmp_path / "nan.json")
    (tmp_path / "one.json").write_text("[[1]]")
    with pytest.raises(ValueError, match=r"at least 2 experts, got \(1, 1\)"):
        load_logits(tmp_path / "one.json")


def test_elastic_moe_main_dispatches_to_the_lab(capsys):
    from elastic_moe_plugin.cli import main

    assert main(["gates", "--two-logit", "--x", "1", "--w", "1"]) == 0
    assert "0.622459" in capsys.readouterr().out

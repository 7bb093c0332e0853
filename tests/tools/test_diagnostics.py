"""``elastic-moe diagnose`` on tiny transformers OLMoE models (2 layers, 8 experts, top-2, hidden 32).

Model B is a copy of model A whose router weights are perturbed. References are written out from
the definitions (paper §6, Eq. 11-12) on router logits that transformers itself returns
(``output_router_logits=True``), with scipy's Jensen-Shannon distance and Python sets; nothing
from ``elastic_moe_plugin.tools.diagnose`` is reused in them.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
scipy_distance = pytest.importorskip("scipy.spatial.distance")

from elastic_moe_plugin import ElasticConfig, cli, hf
from elastic_moe_plugin.tools import diagnose as diagnostics

pytestmark = pytest.mark.hf

LAYERS, EXPERTS, TOPK, HIDDEN, VOCAB = 2, 8, 2, 32, 64
SEQ, NUM_SEQ = 12, 6


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: intra-op threads only oversubscribe shared CI cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _config(**overrides):
    values = {"hidden_size": HIDDEN, "intermediate_size": 32, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": VOCAB, "max_position_embeddings": 64, "num_experts": EXPERTS,
              "num_experts_per_tok": TOPK, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    values.update(overrides)
    return transformers.OlmoeConfig(**values)


def _model(seed=0, **overrides):
    torch.manual_seed(seed)
    model = transformers.OlmoeForCausalLM(_config(**overrides))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() >= 2:
                # routers get a larger scale so that rankings are far from ties
                parameter.normal_(0.0, 0.5 if name.endswith("mlp.gate.weight") else 0.05, generator=generator)
    return model.eval()


def _perturbed(model, scale=0.3, seed=1):
    copy = _model(seed=0)
    copy.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in copy.model.layers:
            layer.mlp.gate.weight.add_(torch.randn(layer.mlp.gate.weight.shape, generator=generator) * scale)
    return copy


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Saved folders: a (original), a_copy (identical), b (perturbed routers), plus bad variants."""
    root = tmp_path_factory.mktemp("ckpt")
    a = _model()
    paths = {}
    for name, model in (("a", a), ("a_copy", a), ("b", _perturbed(a)), ("experts4", _model(num_experts=4)),
                        ("layers3", _model(num_hidden_layers=3))):
        paths[name] = root / name
        model.save_pretrained(paths[name])
    return paths


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(3, VOCAB, (NUM_SEQ, SEQ), generator=generator)
    path = tmp_path_factory.mktemp("probe") / "probe.pt"
    torch.save(ids, path)
    return path, ids


def _load(path):
    return diagnostics.HFRoutedModel(str(path), path.name)


# ------------------------------------------------------------------------------- pure metrics
def test_pair_token_sums_match_a_hand_computation():
    p = torch.tensor([[0.5, 0.3, 0.1, 0.1], [0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.4, 0.1]], dtype=torch.float64)
    q = torch.tensor([[0.3, 0.5, 0.1, 0.1], [0.4, 0.3, 0.2, 0.1], [0.25, 0.25, 0.4, 0.1]], dtype=torch.float64)
    k = 2
    sums = diagnostics.pair_token_sums(p, q, k)
    # token 0: top-1 0 vs 1, sets {0,1} = {0,1}: a reorder inside the shared set
    # token 1: rankings 3,2,1,0 vs 0,1,2,3: disjoint top-2 sets, each one's ranks 3-4 are the
    #          other's top-2
    # token 2: identical distributions (ties broken identically)
    js = sum(scipy_distance.jensenshannon(p[t].numpy(), q[t].numpy(), base=2) ** 2 for t in range(3))
    assert float(sums["js"]) == pytest.approx(js, rel=1e-10)
    assert float(sums["d1"]) == 2.0
    assert float(sums["dk"]) == pytest.approx((1 - 2 / 2) + (1 - 0 / 2) + 0.0)
    assert float(sums["reorder"]) == 1.0
    # rank retention (symmetrised), ranks 1-2: tokens 0 and 2 keep them, token 1 loses them;
    # ranks 3-4 (past the cutoff): only token 1's lie in the other's top-2
    assert sums["retention"].tolist() == [2.0, 2.0, 1.0, 1.0]
    assert float(sums["tokens"]) == 3.0
    assert float(diagnostics.js_divergence(p, p).abs().max()) == 0.0


def test_boundary_layers_and_peak_block():
    settings = diagnostics.CompareSettings()
    assert diagnostics.boundary_layers(range(16), settings) == (0, 15)
    assert diagnostics.boundary_layers(range(4), diagnostics.CompareSettings(boundary=2)) == (0, 1, 2, 3)
    assert diagnostics.boundary_layers(range(16), diagnostics.CompareSettings(boundary_layers=(0, 1))) == (0, 1)
    values = {layer: 0.1 for layer in range(16)}
    values.update({0: 9.0, 15: 9.0, 3: 0.5, 4: 0.6, 5: 0.7, 6: 0.6, 7: 0.5, 8: 0.2})
    block = diagnostics.peak_block(values, (0, 15), 5)
    assert block["layers"] == "3-7" and block["mean"] == pytest.approx(0.58)


# ------------------------------------------------------------------------------- compare
def _reference(model_a, model_b, ids, k):
    """Per-layer JS (bits), D1, Dk from transformers' own router logits, by the definitions."""
    with torch.no_grad():
        logits_a = model_a(input_ids=ids, output_router_logits=True).router_logits
        logits_b = model_b(input_ids=ids, output_router_logits=True).router_logits
    out = {}
    for layer, (za, zb) in enumerate(zip(logits_a, logits_b)):
        pa, pb = torch.softmax(za.double(), -1).numpy(), torch.softmax(zb.double(), -1).numpy()
        js = np.mean([scipy_distance.jensenshannon(pa[t], pb[t], base=2) ** 2 for t in range(len(pa))])
        top_a = [list(np.argsort(-row, kind="stable")[:k]) for row in pa]
        top_b = [list(np.argsort(-row, kind="stable")[:k]) for row in pb]
        d1 = np.mean([a[0] != b[0] for a, b in zip(top_a, top_b)])
        dk = np.mean([1 - len(set(a) & set(b)) / k for a, b in zip(top_a, top_b)])
        out[layer] = (js, d1, dk)
    return out


def test_identical_models_give_exactly_zero(checkpoints, probe):
    path, _ = probe
    task = diagnostics.load_probe(path)
    results = diagnostics.compare([_load(checkpoints["a"]), _load(checkpoints["a_copy"])], [task],
                                  diagnostics.CompareSettings(sweep=()))
    (summary,) = results["pairs"].values()
    assert summary["D1"] == 0.0 and summary["Dk"] == 0.0 and summary["js_mean"] == 0.0
    assert all(row["js"] == 0.0 and row["d1"] == 0.0 and row["dk"] == 0.0 for row in summary["layers"])
    assert summary["prioritisation"]["rank_retention"] == [1.0, 1.0, 0.0, 0.0]
    assert summary["prioritisation"]["near_cutoff_share"] is None  # no set changes at all


def test_perturbed_routers_match_the_hand_computation(checkpoints, probe):
    path, ids = probe
    a, b = _load(checkpoints["a"]), _load(checkpoints["b"])
    results = diagnostics.compare([a, b], [diagnostics.load_probe(path)],
                                  diagnostics.CompareSettings(sweep=(1, 2, 3), batch_size=4))
    (summary,) = results["pairs"].values()
    reference = _reference(a.model, b.model, ids, TOPK)
    for row in summary["layers"]:
        js, d1, dk = reference[row["layer"]]
        assert row["tokens"] == NUM_SEQ * SEQ
        assert row["js"] == pytest.approx(js, rel=1e-6)
        assert row["d1"] == pytest.approx(d1, abs=1e-12) and row["dk"] == pytest.approx(dk, abs=1e-12)
    assert summary["D1"] == pytest.approx(np.mean([r[1] for r in reference.values()]))
    assert summary["Dk"] == pytest.approx(np.mean([r[2] for r in reference.values()]))
    assert summary["D1"] > 0 and summary["js_mean"] > 0
    # 2 layers, boundary 1: both are boundary layers, nothing non-boundary
    assert summary["boundary_layers"] == [0, 1] and summary["js_nonboundary_mean"] is None
    # the sweep: loss at the native k and at k=3 equal transformers' own loss
    for k in (2, 3):
        with diagnostics.HFRoutedModel.topk(a, k), torch.no_grad():
            expected = float(a.model(input_ids=ids, labels=ids).loss)
        assert results["topk_sweep"][a.info.label]["k"][str(k)]["loss"] == pytest.approx(expected, rel=1e-5)
    assert results["topk_sweep"][a.info.label]["k"]["2"]["tokens"] == NUM_SEQ * (SEQ - 1)


def test_two_probe_tasks_are_averaged_with_equal_weight(checkpoints, probe, tmp_path):
    path, ids = probe
    short = tmp_path / "short.json"
    short.write_text(json.dumps(ids[:2, :5].tolist()))
    a, b = _load(checkpoints["a"]), _load(checkpoints["b"])
    settings = diagnostics.CompareSettings(sweep=())
    both = diagnostics.compare([a, b], [diagnostics.load_probe(path), diagnostics.load_probe(short)], settings)
    one = diagnostics.compare([a, b], [diagnostics.load_probe(path)], settings)
    two = diagnostics.compare([a, b], [diagnostics.load_probe(short)], settings)
    d1 = [next(iter(r["pairs"].values()))["D1"] for r in (one, two)]
    assert next(iter(both["pairs"].values()))["D1"] == pytest.approx(sum(d1) / 2)


def test_probe_formats_read_the_same_ids(tmp_path):
    ids = [[5, 6, 7, 8], [9, 10, 11]]
    files = {
        "a.pt": lambda p: torch.save({"input_ids": [torch.tensor(r) for r in ids][0:0] or ids}, p),
        "b.npy": lambda p: np.save(p, np.array(ids[0])),
        "c.json": lambda p: p.write_text(json.dumps(ids)),
        "d.jsonl": lambda p: p.write_text("\n".join(json.dumps({"input_ids": r}) for r in ids)),
        "e.txt": lambda p: p.write_text("\n".join(" ".join(map(str, r)) for r in ids) + "\n\n"),
    }
    for name, write in files.items():
        write(tmp_path / name)
        task = diagnostics.load_probe(tmp_path / name)
        expected = ids[:1] if name.endswith(".npy") else ids
        assert [s.tolist() for s in task.sequences] == expected, name
    assert [w.tolist() for w in diagnostics.chunk_sequences([torch.arange(7)], 3)] == [[0, 1, 2], [3, 4, 5]]


def test_text_probe_with_a_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "the": 3, "cat": 4, "sat": 5, "on": 6, "mat": 7}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    text = tmp_path / "probe.txt"
    text.write_text("the cat sat\n\non the mat\n")
    task = diagnostics.load_probe(text, tokenizer=tokenizer)
    assert [s.tolist() for s in task.sequences] == [[3, 4, 5], [6, 3, 7]]


# ------------------------------------------------------------------------------- CLI
def _assert_png(path):
    import matplotlib.image

    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    assert float(image[..., :3].std()) > 0.01, f"{path} is blank"


def test_cli_compare_writes_json_csv_and_plots(checkpoints, probe, tmp_path, capsys):
    path, _ = probe
    out = tmp_path / "out"
    code = cli.main(["diagnose", "compare", f"A={checkpoints['a']}", f"B={checkpoints['b']}", "--probe", str(path),
                     "--topk-sweep", "1-3", "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "A vs B" in printed and "inference top-k sweep" in printed
    results = json.loads((out / "diagnostics.json").read_text())
    assert set(results["topk_sweep"]["A"]["k"]) == {"1", "2", "3"}
    for name in ("divergence_by_layer.png", "disagreement.png", "topk_sweep.png"):
        _assert_png(out / name)
    rows = (out / "divergence_by_layer.csv").read_text().splitlines()
    assert rows[0].startswith("pair,layer,boundary,js") and len(rows) == 1 + LAYERS


def test_router_swap_then_compare_shows_zero_divergence_to_the_donor(checkpoints, probe, tmp_path, capsys):
    path, _ = probe
    swapped = tmp_path / "swapped"
    # B's experts with A's routers is exactly A (B differs from A only in its routers)
    assert cli.main(["diagnose", "swap", "--router-from", str(checkpoints["a"]), "--into", str(checkpoints["b"]),
                     "--out", str(swapped)]) == 0
    out = tmp_path / "out"
    assert cli.main(["diagnose", "compare", f"donor={checkpoints['a']}", f"swapped={swapped}", f"b={checkpoints['b']}",
                     "--probe", str(path), "--topk-sweep", "off", "--no-plots", "--out", str(out)]) == 0
    pairs = json.loads((out / "diagnostics.json").read_text())["pairs"]
    assert pairs["donor vs swapped"]["js_mean"] == 0.0
    assert pairs["donor vs swapped"]["D1"] == 0.0 and pairs["donor vs swapped"]["Dk"] == 0.0
    assert pairs["donor vs b"]["js_mean"] > 0
    record = json.loads((swapped / "router_swap.json").read_text())
    assert record["layers"] == [0, 1]
    # a partial swap changes only the named layer's router
    partial = tmp_path / "partial"
    assert cli.main(["diagnose", "swap", "--router-from", str(checkpoints["a"]), "--into", str(checkpoints["b"]),
                     "--out", str(partial), "--layers", "1"]) == 0
    model = transformers.OlmoeForCausalLM.from_pretrained(partial)
    a = transformers.OlmoeForCausalLM.from_pretrained(checkpoints["a"])
    b = transformers.OlmoeForCausalLM.from_pretrained(checkpoints["b"])
    assert torch.equal(model.model.layers[1].mlp.gate.weight, a.model.layers[1].mlp.gate.weight)
    assert torch.equal(model.model.layers[0].mlp.gate.weight, b.model.layers[0].mlp.gate.weight)
    assert torch.equal(model.model.layers[0].mlp.experts.gate_up_proj, b.model.layers[0].mlp.experts.gate_up_proj)


@pytest.mark.parametrize("case", ["experts", "layers", "probe", "swap-layers", "swap-experts", "token-range"])
def test_cli_bad_inputs_fail_with_a_message(case, checkpoints, probe, tmp_path, capsys):
    path, _ = probe
    a, out = str(checkpoints["a"]), str(tmp_path / "out")
    argv, message = {
        "experts": (["compare", a, str(checkpoints["experts4"]), "--probe", str(path)], "8 experts per layer but"),
        "layers": (["compare", a, str(checkpoints["layers3"]), "--probe", str(path)], "has 2 layers"),
        "probe": (["compare", a, "--probe", str(tmp_path / "missing.pt")], "does not exist"),
        "swap-layers": (["swap", "--router-from", a, "--into", str(checkpoints["b"]), "--layers", "1-5"],
                        "selects layer(s) [2, 3, 4, 5], but the model has 2 layers"),
        "swap-experts": (["swap", "--router-from", a, "--into", str(checkpoints["experts4"])], "experts per layer"),
        "token-range": (["compare", a, "--probe", "TOKENS"], "outside the models' vocabulary"),
    }[case]
    if case == "token-range":
        bad = tmp_path / "big.json"
        bad.write_text(json.dumps([[1, 2, VOCAB + 5]]))
        argv[-1] = str(bad)
    if argv[0] == "compare":
        argv += ["--out", out]
    else:
        argv += ["--out", out]
    assert cli.main(["diagnose", *argv]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and message in err and "Traceback" not in err


def test_kappa_plot_from_live_hf_routing_metrics(tmp_path, capsys):
    """A live elastic forward, its hf.routing_metrics dumped as JSON, plotted against the pmf."""
    with hf.patched(ElasticConfig(schedule="1-3")):
        model = _model().train()
        torch.manual_seed(3)
        model(input_ids=torch.randint(3, VOCAB, (4, 16)), use_cache=False)
        metrics = hf.routing_metrics(model)
    file = tmp_path / "metrics.json"
    file.write_text(json.dumps(metrics))
    out = tmp_path / "out"
    assert cli.main(["diagnose", "kappa", str(file), "--out", str(out)]) == 0
    _assert_png(out / "kappa_histogram.png")
    rows = [line.split(",") for line in (out / "kappa.csv").read_text().splitlines()[1:]]
    pmf = {int(r[2]): float(r[4]) for r in rows if r[1] == "0"}
    q = [math.exp(-((r - 2) ** 2) / (2 * 1.5 ** 2)) for r in (1, 2, 3)]
    assert [pmf[r] for r in (1, 2, 3)] == pytest.approx([v / sum(q) for v in q], abs=1e-7)  # CSV: 8 digits
    observed = {int(r[2]): float(r[3]) for r in rows if r[1] == "1"}
    assert sum(observed.values()) == pytest.approx(1.0)
    assert observed[1] == pytest.approx(metrics["elastic_moe/layer_1/kappa_frac_1"])


def test_kappa_plot_of_a_log_with_layer_means_only_names_the_per_layer_switch(tmp_path, capsys):
    """A megatron sft / Megatron-LM log without Megatron's per-layer switch holds layer means only:
    the refusal says so and spells the switch for both launchers."""
    file = tmp_path / "logging.jsonl"
    file.write_text("\n".join(json.dumps({"loss": 1.0, "elastic_moe/kappa_frac_2": 0.5, "elastic_moe/mean_kappa": 2.0})
                              for _ in range(2)))
    assert cli.main(["diagnose", "kappa", str(file), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "no 'elastic_moe/layer_<i>/kappa_frac_<r>' values in it. It holds layer means only" in err
    assert """--megatron_extra_kwargs '{"moe_per_layer_logging": true}' (megatron sft)""" in err
    assert "--moe-per-layer-logging (Megatron-LM)" in err and "Traceback" not in err


@pytest.mark.parametrize("family", ["gemma4", "dbrx"])
def test_routed_model_reads_the_router_distribution_of_other_router_shapes(family, tmp_path):
    """Gemma 4's router sits on the decoder layer and returns probabilities; DBRX routes in its FFN
    block, whose router module returns the logits: the distribution captured per layer is the
    router's softmax(z) in both, computed here from the router's own weights."""
    from transformers import DbrxConfig, DbrxForCausalLM, Gemma4ForCausalLM, Gemma4TextConfig

    torch.manual_seed(0)
    if family == "gemma4":
        model = Gemma4ForCausalLM(Gemma4TextConfig(
            vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, global_head_dim=8, hidden_size_per_layer_input=0,
            enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=16,
            layer_types=["sliding_attention"] * 2, sliding_window=4))
    else:
        model = DbrxForCausalLM(DbrxConfig(
            d_model=32, n_heads=4, n_layers=2, max_seq_len=16, vocab_size=64,
            attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
            ffn_config={"ffn_hidden_size": 16, "moe_num_experts": 8, "moe_top_k": 2}))
    model.save_pretrained(tmp_path)
    routed = _load(tmp_path)
    assert (routed.info.moe_layers, routed.info.num_experts, routed.info.topk) == ((0, 1), 8, 2)
    router_inputs = {}
    for layer, router in routed.routers.items():
        router.register_forward_pre_hook(lambda module, args, layer=layer: router_inputs.__setitem__(layer, args[0]))
    ids = torch.randint(3, 64, (2, 6))
    _, captured = routed.forward(ids, torch.ones_like(ids, dtype=torch.bool), capture=True)
    for layer, router in routed.routers.items():
        hidden = router_inputs[layer].reshape(-1, 32).double()
        if family == "gemma4":  # z = proj(x / rms(x) · scale · H^-1/2)
            normed = hidden / (hidden.square().mean(-1, keepdim=True) + router.eps).sqrt()
            logits = (normed * router.scale.double() * 32**-0.5) @ router.proj.weight.double().T
        else:
            logits = hidden @ router.layer.weight.double().T
        torch.testing.assert_close(routed.router_distribution(captured[layer]).double(), torch.softmax(logits, -1),
                                   rtol=1e-5, atol=1e-6)

"""CUDA graphs under elastic routing (``elastic_moe_plugin.mcore.graph_options``): every scope kind,
accepted or refused, at router build (``TransformerConfig`` attributes, megatron-core 0.19 and 0.16)
and before Megatron-LM starts (its flags).

κ is drawn on the host and copied in at every training forward inside the router's routing, so a
graph that replays the router would reuse the κ of its capture: refused, naming the scopes to drop,
with a fix that is itself accepted (each refused case re-runs the check with the fix applied).
Scopes that leave the router eager, inference-only graphs and ``schedule="static"`` are accepted.
The patched router also refuses an elastic forward while a graph is being captured (the backstop).
"""

from __future__ import annotations

import pytest
import torch

from elastic_moe_plugin import ElasticConfig, mcore
from elastic_moe_plugin.core.errors import UnsupportedMegatronError
from elastic_moe_plugin.mcore import graph_options
from elastic_moe_plugin.mcore.megatron_args import check_megatron_args, megatron_options

pytestmark = [pytest.mark.megatron]

SCHEDULE = "1-3"
#: name -> (cuda_graph_impl, scopes, hybrid model, inference graphs owned by the block)
ACCEPTED = {
    "no graph": ("none", [], False, False),
    "TE attn": ("transformer_engine", ["attn"], False, False),
    "TE mlp (dense layers)": ("transformer_engine", ["mlp"], False, False),
    "TE mamba": ("transformer_engine", ["mamba"], False, False),
    "TE attn + mamba": ("transformer_engine", ["attn", "mamba"], False, False),
    "local attn, hybrid model": ("local", ["attn"], True, False),
    "local mamba": ("local", ["mamba"], False, False),
    "local, inference graphs only (block)": ("local", [], False, True),
}
#: name -> (cuda_graph_impl, scopes, hybrid model, what the message names, the fix: (impl, scopes))
REFUSED = {
    "TE whole layer": ("transformer_engine", [], False, "captures the whole layer", ("transformer_engine", ["attn"])),
    "local whole layer": ("local", [], False, "captures the whole layer", ("transformer_engine", ["attn"])),
    "local whole layer, hybrid model": ("local", [], True, "captures the whole layer", ("local", ["attn"])),
    "TE moe": ("transformer_engine", ["moe"], False, "drop 'moe'", ("transformer_engine", ["attn"])),
    "TE attn + moe_router": ("transformer_engine", ["attn", "moe_router"], False, "drop 'moe_router'",
                             ("transformer_engine", ["attn"])),
    "TE moe_router + moe_preprocess": ("transformer_engine", ["moe_router", "moe_preprocess"], False,
                                       "drop 'moe_router', 'moe_preprocess'", ("transformer_engine", ["attn"])),
    "local moe_router, hybrid model": ("local", ["attn", "moe_router", "moe_preprocess"], True,
                                       "drop 'moe_router', 'moe_preprocess'", ("local", ["attn"])),
    "local attn, GPT model": ("local", ["attn"], False, "graphs a GPT TransformerLayer whole",
                              ("transformer_engine", ["attn"])),
    "full iteration": ("full_iteration", [], False, "captures the whole training iteration",
                       ("transformer_engine", ["attn"])),
}


# ====================================================================================== router build
def _megatron_019() -> bool:
    from megatron.core.transformer.transformer_config import TransformerConfig

    return "cuda_graph_modules" in TransformerConfig.__dataclass_fields__


def _set_graphs(config, impl: str, scopes: list[str], hybrid: bool = False, block: bool = False) -> None:
    """The CUDA-graph options as megatron-core holds them after ``__post_init__`` (set after
    construction: its own checks want Transformer Engine and a GPU): 0.19's ``cuda_graph_modules``
    and ``full_iteration`` implementation, 0.16's ``cuda_graph_scope`` with a ``full_iteration`` scope."""
    from megatron.core.transformer import enums

    config.is_hybrid_model = hybrid
    if _megatron_019():
        config.cuda_graph_impl = impl
        config.cuda_graph_modules = [enums.CudaGraphModule[name] for name in scopes]
        config.inference_cuda_graph_scope = enums.InferenceCudaGraphScope.block if block else None
        return
    if impl == "full_iteration":
        impl, scopes = "local", [*scopes, "full_iteration"]
    config.cuda_graph_impl = impl
    config.cuda_graph_scope = [enums.CudaGraphScope[name] for name in scopes]


@pytest.mark.usefixtures("mcore_env")
@pytest.mark.parametrize("name", list(ACCEPTED))
def test_a_scope_that_leaves_the_router_eager_is_accepted(name, make_config, make_router):
    impl, scopes, hybrid, block = ACCEPTED[name]
    if block and not _megatron_019():
        pytest.skip("inference_cuda_graph_scope is megatron-core 0.19's")
    config = make_config(moe_token_dispatcher_type="alltoall")
    _set_graphs(config, impl, scopes, hybrid, block)
    for sampling in ("iid", "balanced"):
        with mcore.patched(ElasticConfig(schedule=SCHEDULE, sampling=sampling)):
            router = make_router(config)
            router(torch.randn(4, 2, 16))  # the first training forward re-runs the checks


@pytest.mark.usefixtures("mcore_env")
@pytest.mark.parametrize("name", list(REFUSED))
def test_a_scope_that_captures_the_router_is_refused_with_a_fix_that_is_accepted(name, make_config, make_router):
    impl, scopes, hybrid, names, (fixed_impl, fixed_scopes) = REFUSED[name]
    config = make_config(moe_token_dispatcher_type="alltoall")
    _set_graphs(config, impl, scopes, hybrid)
    setting = graph_options.graph_setting(config)
    assert graph_options.fixed_setting(setting) == (fixed_impl, tuple(fixed_scopes))
    fix = graph_options.spell_fix(setting, flags=False)
    with mcore.patched(ElasticConfig(schedule=SCHEDULE)), pytest.raises(UnsupportedMegatronError) as caught:
        make_router(config)
    message = str(caught.value)
    assert "CUDA graph that captures the router" in message and "replay would reuse the κ" in message, message
    assert names in message and fix in message, message
    attribute = "cuda_graph_modules" if _megatron_019() else "cuda_graph_scope"
    assert f"{attribute}={fixed_scopes!r}" in fix, fix
    # an elastic `layers` subset does not help: Megatron applies a scope to every layer alike
    with mcore.patched(ElasticConfig(schedule=SCHEDULE, layers="0")), pytest.raises(UnsupportedMegatronError):
        make_router(config)
    with mcore.patched(ElasticConfig(schedule="static")):
        make_router(config)  # the point mass is stock: every graph stays allowed
    _set_graphs(config, fixed_impl, fixed_scopes, hybrid)
    with mcore.patched(ElasticConfig(schedule=SCHEDULE)):
        make_router(config)(torch.randn(4, 2, 16))


@pytest.mark.usefixtures("mcore_env")
def test_an_elastic_forward_inside_a_graph_capture_is_refused(make_config, make_router, monkeypatch):
    """The backstop for what a config cannot show: Megatron's capture flag is up while the router's
    training forward runs. Evaluation and static layers route stock, captured or not."""
    from megatron.core.transformer import cuda_graphs

    config = make_config(moe_token_dispatcher_type="alltoall")
    _set_graphs(config, "transformer_engine", ["attn"])
    x = torch.randn(4, 2, 16)
    with mcore.patched(ElasticConfig(schedule=SCHEDULE, layers="1")):
        elastic, static = make_router(config, layer_number=2), make_router(config, layer_number=1)
        monkeypatch.setattr(cuda_graphs, "_IS_GRAPH_CAPTURING", True)
        with pytest.raises(UnsupportedMegatronError, match=r"being captured into a CUDA graph.*κ is drawn on the host"):
            elastic(x)
        static(x)
        elastic.eval()
        with torch.no_grad():
            elastic(x)
        monkeypatch.setattr(cuda_graphs, "_IS_GRAPH_CAPTURING", False)
        elastic.train()
        elastic(x)


# ====================================================================================== Megatron-LM flags
BASE = ["--num-layers", "4", "--num-experts", "8", "--moe-router-topk", "2", "--moe-token-dispatcher-type",
        "alltoall"]
GRAPH_FLAGS = {"--cuda-graph-impl": 1, "--cuda-graph-modules": None, "--cuda-graph-scope": None,
               "--enable-cuda-graph": 0, "--external-cuda-graph": 0}


def _flags(impl: str, scopes: list[str], hybrid: bool = False, block: bool = False,
           attribute: str = "--cuda-graph-modules") -> list[str]:
    args = [*BASE, "--cuda-graph-impl", impl] + ([attribute, *scopes] if scopes else [])
    return args + (["--is-hybrid-model"] if hybrid else []) + (["--inference-cuda-graph-scope", "block"] if block else [])


def _without_graph_flags(args: list[str]) -> list[str]:
    kept, i = [], 0
    while i < len(args):
        if args[i] in GRAPH_FLAGS:
            i += 1
            while i < len(args) and not args[i].startswith("--"):
                i += 1
            continue
        kept.append(args[i])
        i += 1
    return kept


def _check(args: list[str], schedule: str = SCHEDULE) -> None:
    check_megatron_args(ElasticConfig(schedule=schedule), args)


@pytest.mark.parametrize("name", list(ACCEPTED))
def test_the_flags_of_a_scope_that_leaves_the_router_eager_are_accepted(name):
    _check(_flags(*ACCEPTED[name]))


@pytest.mark.parametrize("attribute", ["--cuda-graph-modules", "--cuda-graph-scope"])
@pytest.mark.parametrize("name", list(REFUSED))
def test_the_flags_of_a_scope_that_captures_the_router_are_refused_with_their_fix(name, attribute):
    impl, scopes, hybrid, names, (fixed_impl, fixed_scopes) = REFUSED[name]
    args = _flags(impl, scopes, hybrid, attribute=attribute)
    fix = graph_options.spell_fix(graph_options.graph_setting(megatron_options(args)), flags=True)
    if scopes:  # the scope flag the user wrote; without one, 0.19's, and 0.16's in parentheses
        assert fix.endswith(f"{attribute} {' '.join(fixed_scopes)}"), fix
    else:
        attribute = "--cuda-graph-modules"
        assert fix.endswith("--cuda-graph-modules attn; --cuda-graph-scope attn before megatron-core 0.19"), fix
    with pytest.raises(UnsupportedMegatronError) as caught:
        _check(args)
    message = str(caught.value)
    assert names in message and fix in message and "--elastic-moe-schedule static" in message, message
    _check(args, schedule="static")
    _check([*_without_graph_flags(args), "--cuda-graph-impl", fixed_impl, attribute, *fixed_scopes])


@pytest.mark.parametrize(("legacy", "fixed_impl"), [("--enable-cuda-graph", "transformer_engine"),
                                                    ("--external-cuda-graph", "transformer_engine")])
def test_the_deprecated_switches_are_read_as_the_implementation_they_select(legacy, fixed_impl):
    """--enable-cuda-graph is the local implementation, --external-cuda-graph Transformer Engine's,
    both capturing the whole layer by default; Megatron-LM refuses them with --cuda-graph-impl, so
    the fix removes the switch."""
    args = [*BASE, legacy]
    with pytest.raises(UnsupportedMegatronError, match=rf"{legacy} with an empty --cuda-graph-modules") as caught:
        _check(args)
    assert (f"remove {legacy}, then --cuda-graph-impl {fixed_impl} --cuda-graph-modules attn; --cuda-graph-scope "
            "attn before megatron-core 0.19)") in str(caught.value)
    _check([*BASE, "--cuda-graph-impl", fixed_impl, "--cuda-graph-modules", "attn"])


@pytest.mark.parametrize(("scopes", "refused"), [
    (["full_iteration_inference"], False),  # migrated to --inference-cuda-graph-scope block: inference only
    (["full_iteration"], True),  # migrated to --cuda-graph-impl full_iteration
    (["full"], True),  # the whole layer
])
def test_the_deprecated_scope_values(scopes, refused):
    args = [*BASE, "--cuda-graph-impl", "local", "--cuda-graph-modules", *scopes]
    if not refused:
        _check(args)
        return
    with pytest.raises(UnsupportedMegatronError, match="CUDA graph that captures the router"):
        _check(args)

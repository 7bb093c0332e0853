"""The patch contract, once for both adapters (``hf`` and ``mcore``), on the real frameworks.

Both adapters run the one lifecycle of :mod:`elastic_moe_plugin.core.patching`; this suite pins
what that promises, adapter by adapter:

- ``apply`` replaces every target at class level with a marked wrapper of the stock object;
  applying the same config again changes nothing (identity); a different config re-installs;
- ``remove`` restores every target by identity, twice is a no-op, and nothing is left marked;
- ``patched`` restores the state from before (unpatched, or the previous config), also on error;
- a failing version guard leaves nothing patched;
- a replacement is never stacked on a replacement (a second copy of the package unwraps first);
- the decisions the two copies used to disagree on: one lock type (re-entrant), and one rule for
  two routers with the same layer index (a ValueError naming both).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from elastic_moe_plugin import ElasticConfig
from elastic_moe_plugin.core.errors import UnsupportedFrameworkError
from elastic_moe_plugin.core.patching import PATCH_MARKER, PatchLifecycle, unwrap
from elastic_moe_plugin.core.records import latest_record

HAVE_MEGATRON = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None
HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


@dataclasses.dataclass
class Adapter:
    name: str
    module: Any                                  # elastic_moe_plugin.hf / .mcore
    patch_module: Any                            # its .patch (the lifecycle lives there)
    version_function: str                        # the name the version guard reads
    targets: Callable[[], list[tuple[Any, str]]]  # (owner, attribute) the patch replaces
    stacked_routers: Callable[[], torch.nn.Module]  # a module with two routers claiming one layer index


def _hf_targets():
    from elastic_moe_plugin import hf
    from elastic_moe_plugin.hf.families import load_family

    points = []
    for family in hf.FAMILIES:
        loaded = load_family(family)
        if not isinstance(loaded, str):
            points += [(loaded.router, family.patched_method)] + [(layer, "__init__") for layer in loaded.decoder_layers]
            if family.merging_block:
                points.append((getattr(loaded.module, family.merging_block), "forward"))
            if "load_balancing_loss_func" in vars(loaded.module):  # families without a Switch loss have none
                points.append((loaded.module, "load_balancing_loss_func"))
            if loaded.experts is not None:
                points.append((loaded.experts, "forward"))
    from transformers.trainer import Trainer

    points += [(Trainer, "_save_rng_state"), (Trainer, "_load_rng_state")]  # κ's generator in rng_state files
    return list(dict.fromkeys((owner, name) for owner, name in points).keys())


def _hf_stacked_routers():
    from transformers.models.olmoe.configuration_olmoe import OlmoeConfig
    from transformers.models.olmoe.modeling_olmoe import OlmoeForCausalLM

    from elastic_moe_plugin import hf

    config = OlmoeConfig(hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=64, num_experts=4, num_experts_per_tok=2)
    model = OlmoeForCausalLM(config).train()
    for layer in model.model.layers:
        hf.set_layer_index(layer.mlp.gate, 0)  # both routers claim decoder layer 0
    model(input_ids=torch.randint(0, 64, (1, 4)))
    return model


#: the dispatcher methods that size their buffers from k, which the patch fixes for κ
#: (docs/parallelism.md), wherever the installed megatron-core defines them on the class itself
#: (HybridEP reads the map itself and needs no fix)
DISPATCHER_TARGETS = (("MoEAlltoAllTokenDispatcher", "preprocess"), ("_DeepepManager", "setup_metadata"),
                      ("_NCCLEPManager", "setup_metadata"), ("MoEFlexTokenDispatcher", "dispatch_preprocess"))


def _mcore_targets():
    from megatron.core.transformer.moe import token_dispatcher
    from megatron.core.transformer.moe.router import TopKRouter

    from elastic_moe_plugin.mcore import dispatch

    targets = [(TopKRouter, "routing"), (TopKRouter, "__init__")]
    if dispatch.SPEC_FIXES.is_on:
        # An ElasticTopKRouter built earlier in this process holds the dispatcher fixes for the life
        # of the process (the explicit-spec route): they are not the patch's to restore.
        return targets
    owners = [(getattr(token_dispatcher, owner, None), name) for owner, name in DISPATCHER_TARGETS]
    return targets + [(owner, name) for owner, name in owners if owner is not None and name in vars(owner)]


def _mcore_stacked_routers():
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2, num_moe_experts=4,
                               moe_router_topk=2, use_cpu_initialization=True, add_bias_linear=False)
    routers = torch.nn.ModuleList([TopKRouter(config=config, pg_collection=get_default_pg_collection()) for _ in range(2)])
    for router in routers:
        router.set_layer_number(1)  # both claim layer 1
        router.train()(torch.randn(4, 1, 16))
    return routers


def _adapters() -> list:
    cases = []
    if HAVE_TRANSFORMERS:
        cases.append(pytest.param("hf", marks=pytest.mark.hf, id="hf"))
    if HAVE_MEGATRON:
        cases.append(pytest.param("mcore", marks=pytest.mark.megatron, id="mcore"))
    return cases


@pytest.fixture(params=_adapters())
def adapter(request) -> Adapter:
    if request.param == "hf":
        from elastic_moe_plugin import hf
        from elastic_moe_plugin.hf import patch

        case = Adapter("hf", hf, patch, "transformers_version", _hf_targets, _hf_stacked_routers)
    else:
        request.getfixturevalue("mcore_env")
        from elastic_moe_plugin import mcore
        from elastic_moe_plugin.mcore import patch

        case = Adapter("mcore", mcore, patch, "megatron_core_version", _mcore_targets, _mcore_stacked_routers)
    case.module.remove()
    yield case
    case.module.remove()


def _snapshot(targets):
    return {(id(owner), name): owner.__dict__[name] for owner, name in targets}


def _assert_stock(targets, stock):
    for owner, name in targets:
        current = owner.__dict__[name]
        assert current is stock[(id(owner), name)], f"{owner.__qualname__}.{name} not restored"
        assert not getattr(current, PATCH_MARKER, False)


# ---------------------------------------------------------------------------------- apply / remove
def test_apply_wraps_every_target_and_remove_restores_identity(adapter):
    targets = adapter.targets()
    stock = _snapshot(targets)
    adapter.module.apply(ElasticConfig(schedule="1-3"))
    assert adapter.module.is_applied() and adapter.module.active_config() == ElasticConfig(schedule="1-3")
    for owner, name in targets:
        current = owner.__dict__[name]
        assert getattr(current, PATCH_MARKER, False), f"{owner.__qualname__}.{name} not patched"
        assert current.__wrapped__ is stock[(id(owner), name)]  # wraps the stock object, not a wrapper
    adapter.module.remove()
    assert not adapter.module.is_applied() and adapter.module.active_config() is None
    _assert_stock(targets, stock)
    adapter.module.remove()  # a second remove is a no-op
    _assert_stock(targets, stock)


def test_same_config_is_a_no_op_and_a_new_config_reinstalls_over_stock(adapter):
    targets = adapter.targets()
    stock = _snapshot(targets)
    adapter.module.apply(ElasticConfig(schedule="1-3"))
    first = _snapshot(targets)
    adapter.module.apply(ElasticConfig(schedule="1-3"))
    assert _snapshot(targets) == first  # identical objects: nothing re-installed
    adapter.module.apply(ElasticConfig(schedule="static"))
    assert adapter.module.active_config().schedule == "static"
    for owner, name in targets:
        assert unwrap(owner.__dict__[name]) is stock[(id(owner), name)]
        assert owner.__dict__[name].__wrapped__ is stock[(id(owner), name)]  # never stacked
    adapter.module.remove()
    _assert_stock(targets, stock)


def test_patched_restores_the_previous_state_also_on_error(adapter):
    targets = adapter.targets()
    stock = _snapshot(targets)
    with adapter.module.patched(ElasticConfig(schedule="1-3")):
        assert adapter.module.active_config().schedule == "1-3"
    _assert_stock(targets, stock)
    adapter.module.apply(ElasticConfig(schedule="static"))
    with pytest.raises(RuntimeError, match="boom"), adapter.module.patched(ElasticConfig(schedule="1-3")):
        raise RuntimeError("boom")
    assert adapter.module.active_config().schedule == "static"
    adapter.module.remove()
    _assert_stock(targets, stock)


def test_apply_checks_the_config_type_and_the_version_first(adapter, monkeypatch):
    from packaging.version import Version

    targets = adapter.targets()
    stock = _snapshot(targets)
    with pytest.raises(TypeError, match="expects an ElasticConfig"):
        adapter.module.apply({"schedule": "1-3"})
    monkeypatch.setattr(adapter.patch_module, adapter.version_function, lambda: Version("99.0"))
    monkeypatch.delenv(adapter.patch_module.ALLOW_UNSUPPORTED_ENV, raising=False)
    with pytest.raises(UnsupportedFrameworkError, match="99.0"):
        adapter.module.apply(ElasticConfig(schedule="1-3"))
    assert not adapter.module.is_applied()
    _assert_stock(targets, stock)


def test_a_second_copy_of_the_package_does_not_stack_patches(adapter):
    """ms-swift imports the plugin file under a hashed module name; a copy of the adapter's patch
    module with its own lifecycle must wrap the stock object and restore it."""
    targets = adapter.targets()
    stock = _snapshot(targets)
    spec = importlib.util.spec_from_file_location(f"elastic_moe_copy_of_{adapter.name}_patch", adapter.patch_module.__file__)
    copy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copy)
    adapter.module.apply(ElasticConfig(schedule="1-3"))
    try:
        copy.apply(ElasticConfig(schedule="static"))
        for owner, name in targets:
            assert owner.__dict__[name].__wrapped__ is stock[(id(owner), name)]
    finally:
        copy.remove()
        adapter.module.remove()
    _assert_stock(targets, stock)


# ---------------------------------------------------------------------------------- decided once
def test_the_lifecycle_lock_is_reentrant(adapter):
    """``hf.apply(config, model=...)`` re-applies the previous config while holding the lock when the
    model rejects the new one; one lock type for both adapters makes that safe everywhere.

    The adapter's lifecycle is the ``PatchLifecycle`` its ``remove`` is bound to; its
    ``rollback_on_error`` holds the lock, and an apply inside it takes the lock again (a plain Lock
    would deadlock: run in a thread, so that a deadlock fails the test instead of hanging it)."""
    lifecycle = adapter.module.remove.__self__
    assert isinstance(lifecycle, PatchLifecycle)
    errors = []

    def rejected_apply():
        try:
            adapter.module.apply(ElasticConfig(schedule="static"))
            with pytest.raises(RuntimeError, match="rejected"), lifecycle.rollback_on_error():
                adapter.module.apply(ElasticConfig(schedule="1-3"))  # the lock, taken a second time
                raise RuntimeError("rejected")  # the rollback re-applies "static", under the lock
        except BaseException as error:  # noqa: BLE001 - reported by the test's thread
            errors.append(error)

    thread = threading.Thread(target=rejected_apply, daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "deadlock: the lifecycle lock is not re-entrant"
    assert errors == []
    assert adapter.module.active_config() == ElasticConfig(schedule="static")
    adapter.module.remove()


def test_two_routers_with_one_layer_index_are_an_error_naming_both(adapter):
    adapter.module.apply(ElasticConfig(schedule="1-3"))
    model = adapter.stacked_routers()
    with pytest.raises(ValueError, match=r"both have decoder-layer index \d+") as raised:
        adapter.module.routing_records(model)
    with pytest.raises(ValueError, match="both have decoder-layer index"):
        adapter.module.budget_histograms(model)
    names = [name for name, module in model.named_modules() if latest_record(module) is not None]
    assert len(names) == 2 and all(repr(name) in str(raised.value) for name in names)

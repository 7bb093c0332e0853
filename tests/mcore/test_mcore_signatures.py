"""Every method the Megatron patch replaces accepts whatever the stock method accepts, and passes it on.

A newer Megatron may call a patched method with an argument the installed one lacks (Megatron-LM's
SeqTopK branch calls ``self.routing(logits, padding_mask=..., seq_idx=...)``). The replacements take
``*args, **kwargs``: the stock path passes everything on untouched; the elastic path reads what it
knows and refuses, naming it, any other argument not at its default (``routing.unread_arguments``).

:func:`signature_gaps` compares a replacement's own signature with stock's; it is shown to catch a
keyword added to a copy of stock's signature, which a replacement spelled with stock's parameters
(as ``routing(self, logits, padding_mask=None)`` was) would reject with a TypeError.
"""

from __future__ import annotations

import importlib
import inspect
import types

import pytest
import torch

from elastic_moe_plugin import ElasticConfig, mcore
from elastic_moe_plugin.core.errors import UnsupportedMegatronError
from elastic_moe_plugin.core.patching import unwrap
from elastic_moe_plugin.mcore import dispatch
from elastic_moe_plugin.mcore.routing import unread_arguments

pytestmark = [pytest.mark.megatron, pytest.mark.usefixtures("mcore_env")]

S, B, H = 6, 3, 16
_KIND = {inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD}


def signature_gaps(stock, replacement) -> list[str]:
    """The parameters of ``stock`` (``self`` left out) a call could pass that ``replacement``'s own
    signature (not the ``__wrapped__`` one ``functools.wraps`` advertises) cannot take, or could not
    leave out where stock can."""
    theirs = list(inspect.signature(stock).parameters.values())[1:]
    ours = inspect.signature(replacement, follow_wrapped=False).parameters
    var_positional = any(p.kind is p.VAR_POSITIONAL for p in ours.values())
    var_keyword = any(p.kind is p.VAR_KEYWORD for p in ours.values())
    gaps = []
    for parameter in theirs:
        if parameter.kind is parameter.VAR_POSITIONAL:
            ok = var_positional
        elif parameter.kind is parameter.VAR_KEYWORD:
            ok = var_keyword
        else:
            mine = ours.get(parameter.name)
            by_keyword = parameter.kind is not parameter.POSITIONAL_ONLY
            by_position = parameter.kind in _KIND
            keyword_ok = not by_keyword or var_keyword or (mine is not None and mine.kind is not mine.POSITIONAL_ONLY)
            position_ok = not by_position or var_positional or (mine is not None and mine.kind in _KIND)
            optional_ok = parameter.default is parameter.empty or mine is None or mine.default is not mine.empty
            ok = keyword_ok and position_ok and optional_ok
        if not ok:
            gaps.append(f"{parameter.name} ({parameter.kind.description})")
    return gaps


def _with_keyword(function, name: str):
    """A copy of ``function`` whose signature has one more keyword-only parameter ``name=None``."""
    copy = types.FunctionType(function.__code__, function.__globals__, function.__name__, function.__defaults__,
                              function.__closure__)
    signature = inspect.signature(function)
    parameters = [p for p in signature.parameters.values() if p.kind is not p.VAR_KEYWORD]
    tail = [p for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD]
    extra = inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None)
    copy.__signature__ = signature.replace(parameters=[*parameters, extra, *tail])
    return copy


def _patched_methods():
    """(dotted name, owner, attribute) of everything ``mcore.apply`` replaced, and of the dispatcher
    fixes (an explicit-spec router earlier in the session may hold those for the process)."""
    found = []
    for symbol in sorted({*mcore.patched_symbols(), *dispatch.installed_targets()}):
        parts = symbol.split(".")
        for split in range(len(parts) - 1, 0, -1):  # the longest importable module prefix
            try:
                owner = importlib.import_module(".".join(parts[:split]))
            except ImportError:
                continue
            for attribute in parts[split:-1]:
                owner = getattr(owner, attribute)
            found.append((symbol, owner, parts[-1]))
            break
    return found


def test_every_patched_method_takes_what_the_stock_method_takes():
    mcore.apply(ElasticConfig(schedule="1-3"))
    methods = _patched_methods()
    names = {symbol.rsplit(".", 2)[-2] + "." + attribute for symbol, _, attribute in methods}
    assert {"TopKRouter.routing", "TopKRouter.__init__", "MoEAlltoAllTokenDispatcher.preprocess"} <= names, names
    for symbol, owner, attribute in methods:
        replacement = vars(owner)[attribute]
        stock = unwrap(replacement)
        assert stock is not replacement, symbol
        assert signature_gaps(stock, replacement) == [], symbol
        # and stock's signature with one more keyword (what a newer Megatron passes) too
        assert signature_gaps(_with_keyword(stock, "seq_idx"), replacement) == [], symbol


def test_the_explicit_spec_router_takes_what_stock_routing_takes():
    """``mcore.elastic_router_spec``'s ``ElasticTopKRouter`` overrides ``routing`` too: the same rule."""
    from megatron.core.transformer.moe.router import TopKRouter

    from elastic_moe_plugin.mcore import spec

    stock, replacement = TopKRouter.routing, spec.ElasticTopKRouter.routing
    assert signature_gaps(stock, replacement) == []
    assert signature_gaps(_with_keyword(stock, "seq_idx"), replacement) == []


def test_the_checker_reports_a_keyword_the_replacement_cannot_take():
    from megatron.core.transformer.moe.router import TopKRouter

    stock = unwrap(TopKRouter.__dict__["routing"])

    def spelled_like_stock(self, logits, padding_mask=None):  # the replacement before *args, **kwargs
        return None

    def required_mask(self, logits, padding_mask):
        return None

    newer = _with_keyword(stock, "seq_idx")
    assert signature_gaps(stock, spelled_like_stock) == []
    assert signature_gaps(newer, spelled_like_stock) == ["seq_idx (keyword-only)"]
    assert signature_gaps(stock, required_mask) == ["padding_mask (positional or keyword)"]
    with pytest.raises(TypeError, match="seq_idx"):
        spelled_like_stock(None, None, seq_idx=None)


def test_a_keyword_of_a_newer_routing_is_passed_on_and_refused_only_where_elastic_routing_would_drop_it(
        make_config, make_router, monkeypatch):
    """A Megatron whose ``TopKRouter.routing`` takes ``seq_idx``: the patch wraps it, passes the
    keyword on in eval and on static layers, accepts it at its default on elastic layers, and
    refuses it there with a value, naming it."""
    from megatron.core.transformer.moe.router import TopKRouter

    stock = TopKRouter.routing
    seen = []

    def newer_routing(self, logits, padding_mask=None, seq_idx=None):
        seen.append(seq_idx)
        return stock(self, logits, padding_mask=padding_mask)

    monkeypatch.setattr(TopKRouter, "routing", newer_routing)
    config = make_config()
    logits, seq_idx = torch.randn(S, B, 8), torch.zeros(S * B, dtype=torch.long)
    try:
        mcore.apply(ElasticConfig(schedule="1-3", layers="1"))
        elastic, static = make_router(config, layer_number=2), make_router(config, layer_number=1)
        static.routing(logits, seq_idx=seq_idx)  # a static layer: stock, keyword and all
        assert seen[-1] is seq_idx
        probs, routing_map = elastic.routing(logits, seq_idx=None)  # at its default: nothing to drop
        assert set(routing_map.sum(dim=1).tolist()) <= {1, 2, 3} and len(seen) == 1
        elastic.routing(logits, torch.zeros(S, B, dtype=torch.bool))  # padding_mask by position
        with pytest.raises(UnsupportedMegatronError, match=r"TopKRouter.routing was called with seq_idx"):
            elastic.routing(logits, seq_idx=seq_idx)
        with pytest.raises(TypeError, match="bogus"):
            elastic.routing(logits, bogus=1)  # what stock itself does not take: stock's TypeError
        elastic.eval()
        elastic.routing(logits, seq_idx=seq_idx)  # evaluation: stock
        assert seen[-1] is seq_idx and len(seen) == 2
    finally:
        mcore.remove()  # before monkeypatch puts the original back: remove restores newer_routing


def test_unread_arguments_names_what_is_not_at_its_default():
    def stock(self, routing_map, probs, extra=None, *more, flag=False, **rest):
        return None

    assert unread_arguments(stock, 3, (), {})[0] == []
    assert unread_arguments(stock, 3, (None,), {"flag": False})[0] == []
    assert unread_arguments(stock, 3, (1, 2), {"flag": True, "other": 3})[0] == ["extra", "*more", "flag", "other"]
    with pytest.raises(TypeError):
        unread_arguments(lambda self, routing_map, probs: None, 3, (), {"nope": 1})

"""``core.patching``: deferred installs (``AttributePatches.when_imported``) and ``PatchSwitch``, on real modules.

The modules are written to a temporary folder and imported for real; nothing is faked.
"""

from __future__ import annotations

import importlib
import sys

import pytest

from elastic_moe_plugin.core.patching import PATCH_MARKER, AttributePatches, PatchSwitch


@pytest.fixture
def module_dir(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [n for n in sys.modules if n.startswith("elastic_moe_probe_")]:
        del sys.modules[name]


def _write(folder, name: str) -> None:
    (folder / f"{name}.py").write_text("def greet():\n    return 'stock'\n")


def _shout(original):
    return lambda: original().upper()


def test_an_install_waits_for_the_import_and_restore_puts_the_stock_function_back(module_dir):
    _write(module_dir, "elastic_moe_probe_later")
    patches = AttributePatches()
    patches.when_imported("elastic_moe_probe_later", lambda module: patches.wrap(module, "greet", _shout))
    assert "elastic_moe_probe_later" not in sys.modules
    module = importlib.import_module("elastic_moe_probe_later")
    assert module.greet() == "STOCK" and getattr(module.greet, PATCH_MARKER)
    assert type(module.__loader__).__name__ == "SourceFileLoader", "the module keeps its real loader"
    patches.restore()
    assert module.greet() == "stock" and not hasattr(module.greet, PATCH_MARKER)


def test_an_already_imported_module_is_patched_at_once(module_dir):
    _write(module_dir, "elastic_moe_probe_now")
    module = importlib.import_module("elastic_moe_probe_now")
    patches = AttributePatches()
    patches.when_imported("elastic_moe_probe_now", lambda m: patches.wrap(m, "greet", _shout))
    assert module.greet() == "STOCK"
    patches.restore()
    assert module.greet() == "stock"


def test_restore_cancels_a_pending_install_and_leaves_no_finder(module_dir):
    _write(module_dir, "elastic_moe_probe_never")
    from elastic_moe_plugin.core.import_hooks import IMPORT_HOOKS

    # (the one import-hook finder may already be there, holding cpu_runtime's pending fixups)
    finders = list(sys.meta_path)
    patches = AttributePatches()
    patches.when_imported("elastic_moe_probe_never", lambda m: patches.wrap(m, "greet", _shout))
    assert IMPORT_HOOKS in sys.meta_path and "elastic_moe_probe_never" in IMPORT_HOOKS.pending()
    patches.restore()
    assert sys.meta_path == finders and "elastic_moe_probe_never" not in IMPORT_HOOKS.pending()
    assert importlib.import_module("elastic_moe_probe_never").greet() == "stock"


def test_two_deferred_installs_on_one_module_both_run(module_dir):
    _write(module_dir, "elastic_moe_probe_twice")
    first, second = AttributePatches(), AttributePatches()
    seen = []
    first.when_imported("elastic_moe_probe_twice", lambda m: seen.append("first"))
    second.when_imported("elastic_moe_probe_twice", lambda m: seen.append("second"))
    importlib.import_module("elastic_moe_probe_twice")
    assert seen == ["first", "second"]
    first.restore(), second.restore()


def test_a_switch_installs_once_restores_by_identity_and_rolls_back_a_failed_install(module_dir):
    _write(module_dir, "elastic_moe_probe_switch")
    module = importlib.import_module("elastic_moe_probe_switch")
    stock = module.greet
    calls = []

    def install(patches):
        calls.append(1)
        patches.wrap(module, "greet", _shout)

    switch = PatchSwitch(install)
    assert switch.on() and not switch.on() and len(calls) == 1  # idempotent
    assert switch.is_on and module.greet() == "STOCK"
    assert switch.off() and not switch.off()
    assert module.greet is stock and not switch.is_on

    def half_install(patches):
        patches.wrap(module, "greet", _shout)
        raise RuntimeError("second target missing")

    failing = PatchSwitch(half_install)
    with pytest.raises(RuntimeError, match="second target missing"):
        failing.on()
    assert module.greet is stock and not failing.is_on  # what it had replaced is back


def test_the_lifecycle_state_is_two_plain_attributes_written_by_apply_and_remove(module_dir):
    """A router's forward reads ``config`` and ``generation`` as attributes: no property, no call."""
    import logging

    from packaging.version import Version

    from elastic_moe_plugin.core.config import ElasticConfig
    from elastic_moe_plugin.core.errors import UnsupportedFrameworkError
    from elastic_moe_plugin.core.patching import PatchLifecycle, VersionGuard

    _write(module_dir, "elastic_moe_probe_lifecycle")
    module = importlib.import_module("elastic_moe_probe_lifecycle")
    guard = VersionGuard("probe", Version("1"), Version("2"), "ELASTIC_MOE_PROBE_ANY", UnsupportedFrameworkError,
                         "probe")
    lifecycle = PatchLifecycle("probe", lambda config, patches: patches.wrap(module, "greet", _shout), guard,
                               lambda: Version("1.5"), logging.getLogger("elastic_moe_probe"))
    assert {"config", "generation"} <= set(vars(lifecycle))
    assert not isinstance(getattr(PatchLifecycle, "config", None), property)
    assert not isinstance(getattr(PatchLifecycle, "generation", None), property)
    assert lifecycle.config is None and lifecycle.generation == 0 and not lifecycle.is_applied()
    first, second = ElasticConfig(schedule="6-10"), ElasticConfig(schedule="7-9")
    assert lifecycle.apply(first) and not lifecycle.apply(first)
    assert lifecycle.config is first is lifecycle.active_config() and lifecycle.generation == 1
    assert lifecycle.apply(second) and lifecycle.config is second and lifecycle.generation == 2
    assert module.greet() == "STOCK"
    lifecycle.remove()
    assert lifecycle.config is None and lifecycle.generation == 2 and not lifecycle.is_applied()
    assert module.greet() == "stock"

"""``core.import_hooks``: the package's one ``sys.meta_path`` finder, on real modules.

Modules are written to a temporary folder and imported for real. Each test uses its own
:class:`ImportHooks` (the package's :data:`IMPORT_HOOKS` may hold the CPU runtime's pending hooks);
the fixture takes it off ``sys.meta_path`` whatever the test left.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
import types

import pytest

from elastic_moe_plugin.core.import_hooks import IMPORT_HOOKS, ImportHooks, importing_module

PREFIX = "elastic_moe_hooks_probe_"


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [n for n in sys.modules if n.startswith(PREFIX)]:
        del sys.modules[name]


@pytest.fixture
def hooks():
    finder = ImportHooks()
    yield finder
    if finder in sys.meta_path:
        sys.meta_path.remove(finder)


def _write(folder, name: str, body: str = "value = 'body ran'\n") -> None:
    (folder / f"{name}.py").write_text(body)


# ---------------------------------------------------------------------------------- after_import
def test_a_callback_runs_once_right_after_the_body_and_the_module_keeps_its_loader(folder, hooks):
    _write(folder, PREFIX + "after")
    seen = []
    hooks.after_import(PREFIX + "after", lambda module: seen.append((module.value, module.__name__ in sys.modules)))
    module = importlib.import_module(PREFIX + "after")
    assert seen == [("body ran", True)]
    assert type(module.__loader__).__name__ == "SourceFileLoader" and module.__spec__.loader is module.__loader__
    importlib.reload(module)
    assert seen == [("body ran", True)], "a callback runs once"


def test_a_cancelled_callback_never_runs(folder, hooks):
    _write(folder, PREFIX + "cancelled")
    seen = []
    hook = hooks.after_import(PREFIX + "cancelled", seen.append)
    hook.cancel()
    hook.cancel()  # idempotent
    importlib.import_module(PREFIX + "cancelled")
    assert seen == [] and hooks.pending() == []


def test_the_finder_is_on_meta_path_only_while_something_is_registered(folder, hooks):
    _write(folder, PREFIX + "presence")
    before = list(sys.meta_path)
    hook = hooks.after_import(PREFIX + "presence", lambda module: None)
    assert sys.meta_path[0] is hooks and hooks.pending() == [PREFIX + "presence"]
    importlib.import_module(PREFIX + "presence")
    assert hooks not in sys.meta_path and sys.meta_path == before, "the callback ran: nothing is pending"
    served = hooks.serve(lambda name: False, types.ModuleType)
    around = hooks.around_bodies(lambda name: False, lambda module: contextlib.nullcontext())
    served.cancel()
    assert sys.meta_path[0] is hooks, "an around hook is still registered"
    around.cancel()
    hook.cancel()  # already ran: a no-op
    assert sys.meta_path == before


def test_an_error_of_a_callback_propagates_from_the_import_statement(folder, hooks):
    _write(folder, PREFIX + "failing")

    def fail(module):
        raise RuntimeError(f"fix of {module.__name__} failed")

    hooks.after_import(PREFIX + "failing", fail)
    with pytest.raises(RuntimeError, match=f"fix of {PREFIX}failing failed"):
        importlib.import_module(PREFIX + "failing")


def test_a_body_that_raises_runs_no_callback_and_the_callback_stays_pending(folder, hooks):
    _write(folder, PREFIX + "broken", "raise ValueError('broken body')\n")
    seen = []
    hooks.after_import(PREFIX + "broken", seen.append)
    with pytest.raises(ValueError, match="broken body"):
        importlib.import_module(PREFIX + "broken")
    assert seen == [] and hooks.pending() == [PREFIX + "broken"]
    _write(folder, PREFIX + "broken")
    importlib.invalidate_caches()
    sys.modules.pop(PREFIX + "broken", None)
    importlib.import_module(PREFIX + "broken")
    assert [module.value for module in seen] == ["body ran"]


# ---------------------------------------------------------------------------------- around_bodies
def test_around_encloses_each_claimed_body_and_after_callbacks_run_once_it_exited(folder, hooks):
    _write(folder, PREFIX + "outer", f"import {PREFIX}inner\nvalue = 'outer'\n")
    _write(folder, PREFIX + "inner", "value = 'inner'\n")
    events = []

    @contextlib.contextmanager
    def around(module):
        events.append(f"enter {module.__name__[len(PREFIX):]}")
        yield
        events.append(f"exit {module.__name__[len(PREFIX):]}")

    hooks.around_bodies(lambda name: name.startswith(PREFIX), around)
    hooks.after_import(PREFIX + "outer", lambda module: events.append("after outer"))
    importlib.import_module(PREFIX + "outer")
    assert events == ["enter outer", "enter inner", "exit inner", "exit outer", "after outer"]


def test_the_claim_is_asked_when_the_module_is_looked_up(folder, hooks):
    _write(folder, PREFIX + "first")
    _write(folder, PREFIX + "second")
    wanted = {PREFIX + "second"}
    asked, entered = [], []
    hooks.around_bodies(lambda name: asked.append(name) or name in wanted,
                        lambda module: contextlib.nullcontext(entered.append(module.__name__)))
    importlib.import_module(PREFIX + "first")
    importlib.import_module(PREFIX + "second")
    assert entered == [PREFIX + "second"] and {PREFIX + "first", PREFIX + "second"} <= set(asked)


def test_an_around_context_may_complete_a_module_whose_body_failed(folder, hooks):
    _write(folder, PREFIX + "needs_gpu", "def kept():\n    return 1\nimport elastic_moe_hooks_absent_package\n")

    @contextlib.contextmanager
    def complete(module):
        try:
            yield
        except ModuleNotFoundError as error:
            if error.name != "elastic_moe_hooks_absent_package":
                raise
            module.stand_in = True

    hooks.around_bodies(lambda name: name == PREFIX + "needs_gpu", complete)
    module = importlib.import_module(PREFIX + "needs_gpu")
    assert module.stand_in and module.kept() == 1 and sys.modules[PREFIX + "needs_gpu"] is module


def test_an_error_an_around_context_does_not_handle_propagates(folder, hooks):
    _write(folder, PREFIX + "raises", "raise KeyError('from the body')\n")
    exits = []

    @contextlib.contextmanager
    def around(module):
        try:
            yield
        finally:
            exits.append(module.__name__)

    hooks.around_bodies(lambda name: name == PREFIX + "raises", around)
    with pytest.raises(KeyError, match="from the body"):
        importlib.import_module(PREFIX + "raises")
    assert exits == [PREFIX + "raises"] and PREFIX + "raises" not in sys.modules


# ---------------------------------------------------------------------------------- serve
def test_a_provider_serves_a_package_and_its_submodules_until_cancelled(hooks):
    created = []

    def create(name):
        created.append(name)
        module = types.ModuleType(name)
        module.made_by = "provider"
        return module

    hook = hooks.serve(lambda name: name.split(".")[0] == PREFIX + "served", create)
    assert importlib.util.find_spec(PREFIX + "served") is not None and created == [], "a probe creates nothing"
    package = importlib.import_module(PREFIX + "served")
    sub = importlib.import_module(PREFIX + "served.sub")
    assert package.made_by == sub.made_by == "provider" and package.__path__ == []
    assert created == [PREFIX + "served", PREFIX + "served.sub"]
    hook.cancel()
    for name in (PREFIX + "served.sub", PREFIX + "served"):
        del sys.modules[name]
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(PREFIX + "served")


def test_a_served_module_runs_its_after_callbacks(hooks):
    seen = []
    hooks.serve(lambda name: name == PREFIX + "served_after", types.ModuleType)
    hooks.after_import(PREFIX + "served_after", lambda module: seen.append(module.__name__))
    try:
        importlib.import_module(PREFIX + "served_after")
    finally:
        sys.modules.pop(PREFIX + "served_after", None)
    assert seen == [PREFIX + "served_after"] and hooks.pending() == []


def test_a_claim_can_ask_which_module_imports(folder, hooks):
    _write(folder, PREFIX + "importer", f"import {PREFIX}asked\n")
    importers = []
    hooks.serve(lambda name: name == PREFIX + "asked" and not importers.append(importing_module(__file__)),
                types.ModuleType)
    importlib.import_module(PREFIX + "importer")
    assert importers == [PREFIX + "importer"]


# ---------------------------------------------------------------------------------- with other finders
def test_a_finder_that_asks_meta_path_back_does_not_recurse(folder, hooks):
    _write(folder, PREFIX + "asked_back")

    class AsksBack:
        """Like finders that delegate too: resolves every name through the whole meta path."""

        def find_spec(self, name, path=None, target=None):
            if not name.startswith(PREFIX):
                return None
            for finder in sys.meta_path:
                if finder is not self and hasattr(finder, "find_spec"):
                    spec = finder.find_spec(name, path, target)
                    if spec is not None:
                        return spec
            return None

    seen = []
    other = AsksBack()
    hooks.after_import(PREFIX + "asked_back", seen.append)
    sys.meta_path.insert(1, other)
    try:
        module = importlib.import_module(PREFIX + "asked_back")
    finally:
        sys.meta_path.remove(other)
    assert seen == [module]


def test_the_package_has_one_finder_instance():
    from elastic_moe_plugin.core import patching

    assert isinstance(IMPORT_HOOKS, ImportHooks) and patching.IMPORT_HOOKS is IMPORT_HOOKS
    assert [finder for finder in sys.meta_path if isinstance(finder, ImportHooks)] in ([], [IMPORT_HOOKS])


def test_the_child_bootstraps_step_probe_waits_on_the_packages_one_finder(tmp_path):
    """The bench's step probe, switched on at interpreter start by the child bootstrap, registers on
    :data:`IMPORT_HOOKS` (no finder of its own) and wraps the target when its module is imported."""
    import json
    import os
    import subprocess
    from pathlib import Path

    from elastic_moe_plugin.tools import child_bootstrap

    (tmp_path / f"{PREFIX}trainer.py").write_text("def train_step():\n    return 'stepped'\n")
    code = (
        "import json, sys\n"
        "from elastic_moe_plugin.core.import_hooks import IMPORT_HOOKS, ImportHooks\n"
        "finders = [type(f).__name__ for f in sys.meta_path if isinstance(f, ImportHooks)]\n"
        "pending = IMPORT_HOOKS.pending()\n"
        f"import {PREFIX}trainer as trainer\n"
        "print(json.dumps([finders, pending, IMPORT_HOOKS.pending(), hasattr(trainer.train_step, '__wrapped__'),\n"
        "                  trainer.train_step()]))\n"
    )
    root = str(Path(__file__).resolve().parents[2])
    env = {key: value for key, value in os.environ.items() if not key.startswith("E2E_BENCH_")}
    env.update(child_bootstrap.environment(["step_probe"], os.pathsep.join([str(tmp_path), root])),
               E2E_BENCH_TARGET=f"{PREFIX}trainer:train_step", E2E_BENCH_SYNC_STEP="5",
               E2E_BENCH_SYNC_OUT=str(tmp_path / "syncs.json"))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    finders, pending, after, wrapped, result = json.loads(done.stdout.strip().splitlines()[-1])
    assert finders == ["ImportHooks"] and pending == [f"{PREFIX}trainer"] and after == []
    assert wrapped and result == "stepped"

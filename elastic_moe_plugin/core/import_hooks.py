"""The package's one import hook: a ``sys.meta_path`` finder through which code acts on imports.

Three capabilities, each registered on :data:`IMPORT_HOOKS` and undone by :meth:`Hook.cancel`:

- :meth:`ImportHooks.after_import`: run ``callback(module)`` once, right after module ``name``'s
  body has executed. For patches of modules a training script imports after the patch was applied
  (:meth:`~elastic_moe_plugin.core.patching.AttributePatches.when_imported`) and for the bench's
  step probe, which wraps a trainer's ``train_step`` as soon as its module exists.
- :meth:`ImportHooks.around_bodies`: execute the body of every module whose name ``claims(name)``
  accepts inside the context manager ``around(module)``, which may also handle an error the body
  raises. For the CPU runtime's mcore-bridge scope, which must know which module body is running
  (what it lets that body import), complete a module whose body fails on a missing GPU-only
  package, and fix each mcore-bridge module right after its body.
- :meth:`ImportHooks.serve`: answer the import of every name ``claims(name)`` accepts with
  ``create(name)``, a module made here instead of found on the path. For stand-ins of packages that
  are not installed (Transformer Engine for mcore-bridge's bodies, an import stub of mcore-bridge
  for the recipe argument check).

The finder finds nothing itself: for a module some hook acts on, it asks the other finders for the
spec and wraps the loader, and the module keeps its real loader. It sits first on ``sys.meta_path``
only while some hook is registered, so a process that registers none imports exactly as without
this package.

Why one finder rather than one per use: finders that each delegate to the others wrap each other's
loaders in whatever order they happened to be inserted, and one that removes itself can change
that order mid-run. Here the order is fixed: a served module is never searched for; otherwise the
``around`` contexts (in the order registered, the first outermost) enclose the body, and the
``after_import`` callbacks run once all of them have exited.

Standard library only, so importing it loads no framework and no torch: the bench's start-up
module (a ``sitecustomize``) imports it at interpreter start, before the trainer is imported.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import threading
import types
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

ModuleCallback = Callable[[types.ModuleType], None]
NameClaim = Callable[[str], bool]
Around = Callable[[types.ModuleType], AbstractContextManager[Any]]

#: frames of the import system itself, skipped when looking for the code that runs an import
_IMPORT_MACHINERY = ("<frozen importlib", os.path.dirname(importlib.util.__file__))


@dataclasses.dataclass(eq=False)
class Hook:
    """One registration on an :class:`ImportHooks`; :meth:`cancel` removes it (idempotent).

    Attributes:
        kind: ``"after"``, ``"around"`` or ``"serve"``.
        name: the module an ``"after"`` hook waits for (None for the others).
        claims: the names an ``"around"`` or ``"serve"`` hook acts on (None for ``"after"``).
        action: the callback, the context-manager factory or the module factory.
    """

    kind: str
    name: str | None
    claims: NameClaim | None
    action: Callable[..., Any]
    owner: ImportHooks = dataclasses.field(repr=False)

    def cancel(self) -> None:
        self.owner.cancel(self)


class ImportHooks(importlib.abc.MetaPathFinder):
    """The finder behind :data:`IMPORT_HOOKS` (the package uses that one instance; tests may make
    their own). Registration and cancelling are thread-safe; a claim or callback runs outside the
    lock, in the thread doing the import."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._after: dict[str, list[Hook]] = {}
        # tuples, replaced under the lock and never changed in place: find_spec reads them on every
        # import without taking the lock
        self._around: tuple[Hook, ...] = ()
        self._serve: tuple[Hook, ...] = ()
        # names this finder is resolving through the other finders, per thread: a finder that
        # delegates too may ask this one back for the same name
        self._searching = threading.local()

    # ------------------------------------------------------------------ registration
    def after_import(self, name: str, callback: ModuleCallback) -> Hook:
        """Run ``callback(module)`` right after the next execution of module ``name``'s body.

        Once: the hook is gone after it ran. Only a future import counts (a module already in
        ``sys.modules`` is not looked at; callers that want "now if already imported" check that
        themselves). An error raised by ``callback`` propagates out of the ``import`` statement
        that loaded the module; a body that raises runs no callback, which stays pending.
        """
        return self._register(Hook("after", name, None, callback, self))

    def around_bodies(self, claims: NameClaim, around: Around) -> Hook:
        """Execute the body of each module ``claims(name)`` accepts inside ``around(module)``.

        ``claims`` is asked when the import system looks the module up (so it may depend on what
        is executing then); ``around`` is entered with the new module, before its body, and exited
        after it, seeing any error the body raised (a context manager that suppresses it leaves the
        module imported as the body left it). Until cancelled.
        """
        return self._register(Hook("around", None, claims, around, self))

    def serve(self, claims: NameClaim, create: Callable[[str], types.ModuleType]) -> Hook:
        """Answer the import of each name ``claims(name)`` accepts with the module ``create(name)``.

        ``claims`` runs when the name is looked up, ``create`` when the import system creates the
        module (a ``importlib.util.find_spec`` probe creates nothing). The module is imported as a
        package, so the import of a submodule is asked for by name too. Nothing is executed in it;
        ``after_import`` callbacks of the name run. Until cancelled.
        """
        return self._register(Hook("serve", None, claims, create, self))

    def cancel(self, hook: Hook) -> None:
        """Remove ``hook`` (a no-op if it already ran or was cancelled)."""
        with self._lock:
            if hook.kind == "after":
                assert hook.name is not None  # after_import() always names the module
                remaining = [entry for entry in self._after.get(hook.name, []) if entry is not hook]
                if remaining:
                    self._after[hook.name] = remaining
                else:
                    self._after.pop(hook.name, None)
            elif hook.kind == "around":
                self._around = tuple(entry for entry in self._around if entry is not hook)
            else:
                self._serve = tuple(entry for entry in self._serve if entry is not hook)
            self._place_locked()

    def pending(self) -> list[str]:
        """The module names ``after_import`` callbacks are waiting for."""
        with self._lock:
            return sorted(self._after)

    def _register(self, hook: Hook) -> Hook:
        with self._lock:
            if hook.kind == "after":
                assert hook.name is not None  # after_import() always names the module
                self._after.setdefault(hook.name, []).append(hook)
            elif hook.kind == "around":
                self._around = (*self._around, hook)
            else:
                self._serve = (*self._serve, hook)
            self._place_locked()
        return hook

    def _place_locked(self) -> None:
        """First on ``sys.meta_path`` while any hook is registered, absent otherwise."""
        needed = bool(self._after or self._around or self._serve)
        if needed and self not in sys.meta_path:
            sys.meta_path.insert(0, self)
        elif not needed and self in sys.meta_path:
            sys.meta_path.remove(self)

    # ------------------------------------------------------------------ finder
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        searching = self._searching.__dict__.setdefault("names", set())
        if fullname in searching:
            return None
        serving, around, waiting = self._serve, self._around, fullname in self._after
        # serve() and around_bodies() always give claims; None is only an "after" hook's, never in these tuples
        for hook in serving:
            if hook.claims is not None and hook.claims(fullname):
                return importlib.machinery.ModuleSpec(fullname, _ServedLoader(self, hook.action), is_package=True)
        arounds = [hook.action for hook in around if hook.claims is not None and hook.claims(fullname)]
        if not (arounds or waiting):
            return None
        searching.add(fullname)
        try:
            spec = self._find_elsewhere(fullname, path, target)
        finally:
            searching.discard(fullname)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _HookedLoader(self, spec.loader, arounds)
        return spec

    def _find_elsewhere(self, fullname: str, path: Any, target: Any) -> importlib.machinery.ModuleSpec | None:
        for finder in list(sys.meta_path):
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                return spec
        return None

    def _run_after(self, module: types.ModuleType) -> None:
        with self._lock:
            hooks = self._after.pop(module.__name__, [])
            self._place_locked()
        for hook in hooks:
            hook.action(module)


class _HookedLoader(importlib.abc.Loader):
    """The real loader, run inside the ``around`` contexts and followed by the ``after`` callbacks."""

    def __init__(self, hooks: ImportHooks, loader: Any, arounds: list[Around]) -> None:
        self._hooks, self._loader, self._arounds = hooks, loader, arounds

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        # the module answers with its real loader (source lookups, reloads), not this wrapper
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        with contextlib.ExitStack() as stack:
            for around in self._arounds:
                stack.enter_context(around(module))
            self._loader.exec_module(module)
        self._hooks._run_after(module)


class _ServedLoader(importlib.abc.Loader):
    def __init__(self, hooks: ImportHooks, create: Callable[[str], types.ModuleType]) -> None:
        self._hooks, self._create = hooks, create

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return self._create(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        self._hooks._run_after(module)


def importing_module(*skip_files: str) -> str:
    """The ``__name__`` of the module whose code runs the import being resolved now.

    The first frame, walking out, that is neither the import system, this module nor one of
    ``skip_files`` (the caller's own file, typically); ``""`` if there is none. For a ``serve`` or
    ``around_bodies`` claim that depends on who imports, not only on what is imported.
    """
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not (filename.startswith(_IMPORT_MACHINERY) or filename == __file__ or filename in skip_files):
            return frame.f_globals.get("__name__", "")
        frame = frame.f_back
    return ""


#: the package's one import-hook finder
IMPORT_HOOKS = ImportHooks()

__all__ = ["IMPORT_HOOKS", "Hook", "ImportHooks", "importing_module"]

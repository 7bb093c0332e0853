"""The one patch lifecycle of the plugin: class-level replacements, restored by identity.

Four pieces, used by every adapter (``mcore``, ``hf``), the dispatcher fixes, the inference top-k
override and the CPU runtime:

- :class:`AttributePatches`: an ordered record of ``(owner, name, original)``. :meth:`wrap`
  builds the replacement from the *stock* object (any earlier elastic wrapper is unwrapped first,
  so a second copy of this package, e.g. ms-swift importing the plugin file under a hashed module
  name, never stacks a patch on a patch), marks it (``__elastic_moe_patched__``, ``__wrapped__``)
  and remembers the stock object. :meth:`set` redirects an attribute and remembers what was there.
  :meth:`restore` puts the originals back by identity, in reverse order, and deletes attributes
  that did not exist before. :meth:`when_imported` defers an install to the import of the module
  that holds the target (a module the training script imports later).
- :class:`PatchSwitch`: on / off for a patch without a config (the CPU runtime, the explicit-spec
  routers' dispatcher fixes, the ``training_log`` hook): idempotent, a failed install rolls back,
  off restores by identity.
- :class:`VersionGuard`: a framework's tested version range and the variable that overrides it.
- :class:`PatchLifecycle`: ``apply(config)`` / ``remove()`` / ``patched(config)`` for one
  framework. One re-entrant lock (a failed ``apply(config, model=...)`` re-applies the previous
  config while holding it), the framework's version guard on every apply, idempotence (the same
  config again changes nothing), and a generation number that routers key their cached plans on.

An adapter supplies only its version guard and an ``install(config, patches)`` function that
calls :meth:`AttributePatches.wrap` for each target.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.abc
import importlib.machinery
import importlib.metadata
import inspect
import logging
import os
import sys
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

from packaging.version import Version

from elastic_moe_plugin.core.config import ElasticConfig
from elastic_moe_plugin.core.errors import UnsupportedFrameworkError

#: set on every replacement this package installs; its ``__wrapped__`` is what it replaced
PATCH_MARKER = "__elastic_moe_patched__"
#: the "original" of an attribute that did not exist before a patch
MISSING: Any = type("Missing", (), {"__repr__": lambda self: "MISSING"})()


def is_patched(obj: Any) -> bool:
    """Whether ``obj`` is a replacement installed by (some copy of) this package."""
    return bool(getattr(obj, PATCH_MARKER, False))


def unwrap(obj: Any) -> Any:
    """The stock object under any chain of elastic replacements."""
    while is_patched(obj):
        obj = obj.__wrapped__
    return obj


def _qualified(owner: Any, name: str) -> str:
    prefix = owner.__name__ if inspect.ismodule(owner) else f"{owner.__module__}.{owner.__qualname__}"
    return f"{prefix}.{name}"


class AttributePatches:
    """Replacements of attributes on classes and modules, undone in reverse order by identity."""

    def __init__(self) -> None:
        self._entries: list[tuple[Any, str, Any]] = []
        self._undo: list[Callable[[], None]] = []

    def wrap(self, owner: Any, name: str, factory: Callable[[Any], Any]) -> Any:
        """Replace ``owner.<name>`` by ``factory(stock)`` and mark it.

        ``stock`` is the attribute as defined on ``owner`` itself (``vars(owner)``, not inherited),
        unwrapped of earlier elastic replacements; :meth:`restore` puts ``stock`` back, so removing
        a patch leaves stock code even where another copy of this package had patched first.
        Returns the replacement.

        Raises:
            AttributeError: ``owner`` defines no ``name`` of its own.
        """
        found = vars(owner).get(name, MISSING)
        if found is MISSING:
            raise AttributeError(f"{_qualified(owner, name)} does not exist: nothing to wrap.")
        stock = unwrap(found)
        replacement = factory(stock)
        setattr(replacement, PATCH_MARKER, True)
        replacement.__wrapped__ = stock
        self._record(owner, name, stock)
        setattr(owner, name, replacement)
        return replacement

    def set(self, owner: Any, name: str, value: Any) -> None:
        """Set ``owner.<name> = value`` (unmarked: a redirect, not a wrapper), remembering what was there.

        On a class or module the original is the attribute defined on ``owner`` itself (an
        inherited one is re-exposed by deleting the override). On an instance (a router's
        ``top_k``, a model config's ``num_experts_per_tok``) it is the value ``owner`` answers,
        which may come from its class or a property: :meth:`restore` sets that value back.
        """
        original = getattr(owner, "__dict__", {}).get(name, MISSING)
        if original is MISSING and not isinstance(owner, (type, types.ModuleType)) and hasattr(owner, name):
            original = getattr(owner, name)
        self._record(owner, name, original)
        setattr(owner, name, value)

    def when_imported(self, module_name: str, install: Callable[[types.ModuleType], None]) -> None:
        """Run ``install(module)`` (which calls :meth:`wrap` / :meth:`set`) as soon as ``module_name``
        is imported: now if it already is, else right after the module's code has run.

        For targets in modules a training script imports after the patch is applied (Megatron-LM's
        ``megatron.training.training``, imported by the script the entry point runs). A hook still
        pending at :meth:`restore` is cancelled. An error raised by ``install`` propagates out of
        the ``import`` statement that loaded the module.
        """
        module = sys.modules.get(module_name)
        if module is not None:
            install(module)
            return
        hook = _POST_IMPORT.add(module_name, install)
        self._undo.append(lambda: _POST_IMPORT.cancel(hook))

    def on_restore(self, undo: Callable[[], None]) -> None:
        """Run ``undo`` when :meth:`restore` runs (after the attributes are put back)."""
        self._undo.append(undo)

    def _record(self, owner: Any, name: str, original: Any) -> None:
        self._entries.append((owner, name, original))

    def restore(self) -> None:
        """Put every original back, newest first; delete attributes that did not exist."""
        for owner, name, original in reversed(self._entries):
            if original is MISSING:
                with contextlib.suppress(AttributeError):
                    delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._entries.clear()
        undo, self._undo = self._undo, []
        for callback in reversed(undo):
            callback()

    def symbols(self) -> list[str]:
        """Dotted names of the replaced attributes, in the order they were patched."""
        return [_qualified(owner, name) for owner, name, _ in self._entries]

    def __len__(self) -> int:
        return len(self._entries)


class _PostImportHooks(importlib.abc.MetaPathFinder):
    """A ``sys.meta_path`` finder that runs callbacks right after a named module executes.

    It finds nothing itself: for a module with pending callbacks it asks the other finders for the
    spec and wraps the loader so the callbacks run after the module's own code (the module keeps its
    real loader). It sits on ``sys.meta_path`` only while some callback is pending.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._pending: dict[str, list[tuple[object, Callable[[types.ModuleType], None]]]] = {}
        self._searching = threading.local()  # names this finder is resolving through the others

    def add(self, module_name: str, callback: Callable[[types.ModuleType], None]) -> object:
        hook = object()
        with self._lock:
            self._pending.setdefault(module_name, []).append((hook, callback))
            if self not in sys.meta_path:
                sys.meta_path.insert(0, self)
        return hook

    def cancel(self, hook: object) -> None:
        with self._lock:
            for name in list(self._pending):
                self._pending[name] = [entry for entry in self._pending[name] if entry[0] is not hook]
                if not self._pending[name]:
                    del self._pending[name]
            if not self._pending and self in sys.meta_path:
                sys.meta_path.remove(self)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        searching = self._searching.__dict__.setdefault("names", set())
        if fullname not in self._pending or fullname in searching:
            return None  # not ours, or a finder like this one (it delegates too) asking back
        searching.add(fullname)
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                        spec.loader = _RunHooksAfterExec(spec.loader, self)
                    return spec
            return None
        finally:
            searching.discard(fullname)

    def run(self, module: types.ModuleType) -> None:
        with self._lock:
            callbacks = self._pending.pop(module.__name__, [])
            if not self._pending and self in sys.meta_path:
                sys.meta_path.remove(self)
        for _, callback in callbacks:
            callback(module)


class _RunHooksAfterExec(importlib.abc.Loader):
    def __init__(self, loader: Any, hooks: _PostImportHooks) -> None:
        self._loader, self._hooks = loader, hooks

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        self._hooks.run(module)


_POST_IMPORT = _PostImportHooks()


class PatchSwitch:
    """A patch without a config, on or off.

    Args:
        install: ``install(patches)`` makes every replacement through ``patches`` (``wrap``,
            ``set``, ``when_imported``). If it raises, what it already replaced is restored.
    """

    def __init__(self, install: Callable[[AttributePatches], None]) -> None:
        self._install = install
        self._lock = threading.RLock()
        self._patches: AttributePatches | None = None

    def on(self) -> bool:
        """Install (idempotent); True if this call installed it."""
        with self._lock:
            if self._patches is not None:
                return False
            patches = AttributePatches()
            try:
                self._install(patches)
            except BaseException:
                patches.restore()
                raise
            self._patches = patches
            return True

    def off(self) -> bool:
        """Restore every attribute by identity and cancel pending installs (idempotent); True if it was on."""
        with self._lock:
            if self._patches is None:
                return False
            self._patches.restore()
            self._patches = None
            return True

    @property
    def is_on(self) -> bool:
        return self._patches is not None


@dataclasses.dataclass(frozen=True)
class VersionGuard:
    """The tested version range of a framework, and the variable that overrides it.

    Attributes:
        framework: the distribution name users install (``"megatron-core"``, ``"transformers"``).
        minimum / maximum: the tested range ``[minimum, maximum)`` (pre-releases count as their base).
        override_env: setting it to 1 tries an untested version anyway, with a warning.
        error: the :class:`UnsupportedFrameworkError` subclass to raise.
        extra: the package extra that installs the framework (``pip install 'elastic-moe-plugin[extra]'``).
        module: the package Python imports (``"megatron.core"``, ``"transformers"``), so that a refusal
            says where the refused code comes from: an installed wheel (then ``pip install`` is the
            fix) or a source tree on the path that shadows any wheel (then installing cannot help).
    """

    framework: str
    minimum: Version
    maximum: Version
    override_env: str
    error: type[UnsupportedFrameworkError]
    extra: str
    module: str | None = None

    @property
    def range(self) -> str:
        return f">={self.minimum},<{self.maximum}"

    def imported_version(self) -> Version | None:
        """The version of the ``module`` Python imports, i.e. of the code that will be patched.

        Read from the imported package's ``__version__``, not from installed package metadata: a
        source checkout on ``PYTHONPATH`` has no metadata, and with a wheel installed *and* a checkout
        first on ``sys.path`` the metadata describes the wheel while the checkout is what runs. The
        metadata of ``framework`` is read only when the package carries no version; None when
        neither exists.

        Raises:
            importlib.metadata.PackageNotFoundError: ``module`` (or a package above it) is not importable.
        """
        module_name = self.module or self.framework
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            parents = {".".join(module_name.split(".")[: depth + 1]) for depth in range(module_name.count(".") + 1)}
            if error.name in parents:
                raise importlib.metadata.PackageNotFoundError(self.framework) from None
            raise
        found = getattr(module, "__version__", None)
        if found is None:
            try:
                found = importlib.metadata.version(self.framework)
            except importlib.metadata.PackageNotFoundError:
                return None
        return Version(str(found))

    def check(self, read_version: Callable[[], Version | None]) -> Version | None:
        """The version ``read_version()`` finds if inside the range (or overridden, with a warning).

        ``read_version`` returns the version of the code that will be patched, ``None`` when that
        code is importable but carries no version at all, and raises
        ``importlib.metadata.PackageNotFoundError`` when it is not importable. The override
        variable accepts both an out-of-range and an unknown version.

        Raises:
            error: the framework is missing, or outside the range (or of unknown version) and not
                overridden.
        """
        try:
            found = read_version()
        except importlib.metadata.PackageNotFoundError:
            raise self.error(
                f"elastic-moe needs {self.framework} {self.range}, which is not installed: pip install "
                f"'elastic-moe-plugin[{self.extra}]' (or '{self.framework}{self.range}')."
            ) from None
        if found is not None and self.minimum <= Version(found.base_version) < self.maximum:
            return found
        described = "an unknown version (no version attribute, no package metadata)" if found is None else str(found)
        if os.environ.get(self.override_env, "").lower() in ("1", "true", "yes"):
            logging.getLogger("elastic_moe_plugin").warning(
                "elastic-moe: %s %s is outside the tested range %s; %s is set, trying anyway.",
                self.framework, described, self.range, self.override_env)
            return found
        raise self.error(f"elastic-moe supports {self.framework} {self.range}, found {described}. {self.advice()}")

    def advice(self) -> str:
        """What to do about a refused version, for where the imported code comes from (:attr:`module`)."""
        tree = self.source_tree()
        if tree is None:
            return (f"Install a supported version (pip install '{self.framework}{self.range}'), or set "
                    f"{self.override_env}=1 to try anyway.")
        try:
            wheel = f", ahead of the installed {self.framework} {importlib.metadata.version(self.framework)}"
        except importlib.metadata.PackageNotFoundError:
            wheel = ""
        return (f"The {self.module} Python imports is a source tree, {tree} (on sys.path through PYTHONPATH or the "
                f"training script's folder{wheel}), so installing a wheel would not change it: check out a release "
                f"in {self.range} there, or take the tree off the path; or set {self.override_env}=1 to try anyway.")

    def source_tree(self) -> str | None:
        """The folder of the imported :attr:`module` when it is not the installed distribution's own
        files (a source checkout on the path), else None (an installed wheel, or not importable)."""
        module = sys.modules.get(self.module) if self.module else None
        origin = getattr(module, "__file__", None)
        if origin is None:
            return None
        # directories, not files: a tree of symlinks to a wheel's files is still a tree on the path
        package_dir = os.path.realpath(os.path.dirname(os.path.abspath(origin)))
        try:
            distribution = importlib.metadata.distribution(self.framework)
            installed = distribution.locate_file(os.path.join(*self.module.split("."), "__init__.py"))
            if os.path.realpath(os.path.dirname(os.path.abspath(str(installed)))) == package_dir:
                return None
        except importlib.metadata.PackageNotFoundError:
            pass
        return os.path.realpath(os.path.join(package_dir, *[".."] * len(self.module.split("."))))


class PatchLifecycle:
    """``apply`` / ``remove`` / ``patched`` of one framework adapter.

    Args:
        name: the adapter (``"mcore"``, ``"hf"``), for messages.
        install: ``install(config, patches)`` makes every replacement through ``patches``. If it
            raises, whatever it already replaced is restored before the error propagates.
        guard: the framework's tested range, checked on every :meth:`apply`.
        read_version: the version of the framework code being patched (see :meth:`VersionGuard.check`).
        logger: where the one INFO line per apply goes.
    """

    def __init__(
        self,
        name: str,
        install: Callable[[ElasticConfig, AttributePatches], None],
        guard: VersionGuard,
        read_version: Callable[[], Version | None],
        logger: logging.Logger,
    ) -> None:
        self.name = name
        self._install = install
        self._guard = guard
        self._read_version = read_version
        self._logger = logger
        # Re-entrant: rolling back a failed apply re-applies the previous config under the lock.
        self._lock = threading.RLock()
        self._config: ElasticConfig | None = None
        self._patches: AttributePatches | None = None
        self._generation = 0

    # ------------------------------------------------------------------ state
    @property
    def generation(self) -> int:
        """Incremented by every apply that changes the config: routers key cached plans on it."""
        return self._generation

    def active_config(self) -> ElasticConfig | None:
        """The config of the current apply, or None when not applied."""
        return self._config

    def is_applied(self) -> bool:
        """Whether the patch is installed."""
        return self._config is not None

    def symbols(self) -> list[str]:
        """Dotted names of everything the active patch replaced (empty if not applied)."""
        patches = self._patches
        return patches.symbols() if patches is not None else []

    # ------------------------------------------------------------------ verbs
    def resolve(self, config: ElasticConfig | None) -> ElasticConfig:
        """``config``, or :meth:`ElasticConfig.from_env` when None; a TypeError for anything else."""
        config = ElasticConfig.from_env() if config is None else config
        if not isinstance(config, ElasticConfig):
            raise TypeError(f"{self.name}.apply expects an ElasticConfig, got {type(config).__name__}.")
        return config

    def check_version(self) -> Version | None:
        """The framework's version, if supported; else raise (see :meth:`VersionGuard.check`)."""
        return self._guard.check(self._read_version)

    def apply(self, config: ElasticConfig | None = None) -> bool:
        """Install the patch with ``config``; True if anything changed (False: already active)."""
        config = self.resolve(config)
        self.check_version()
        with self._lock:
            if self._config == config:
                return False
            self._remove_locked()
            patches = AttributePatches()
            try:
                self._install(config, patches)
            except BaseException:
                patches.restore()
                raise
            self._patches, self._config = patches, config
            self._generation += 1
        # one short line at INFO (it reaches ms-swift's console); the dotted names at DEBUG
        symbols = patches.symbols()
        owners = sorted({symbol.rpartition(".")[0].rpartition(".")[0] for symbol in symbols})
        self._logger.info("elastic-moe: %s patched (%d attributes in %d modules)", self.name, len(symbols), len(owners))
        self._logger.debug("elastic-moe: patched %s with %s", ", ".join(symbols), config)
        return True

    def remove(self) -> None:
        """Restore every patched attribute by identity. A no-op when not applied."""
        with self._lock:
            self._remove_locked()

    def _remove_locked(self) -> None:
        if self._patches is not None:
            self._patches.restore()
        self._patches, self._config = None, None

    @contextlib.contextmanager
    def rollback_on_error(self) -> Iterator[None]:
        """Restore the state from before the block (applied with its config, or not) if it raises."""
        with self._lock:
            previous = self._config
            try:
                yield
            except BaseException:
                if previous is None:
                    self._remove_locked()
                elif previous != self._config:
                    self.apply(previous)
                raise

    @contextlib.contextmanager
    def patched(self, apply: Callable[..., Any], *args: Any, **kwargs: Any) -> Iterator[None]:
        """``apply(*args, **kwargs)`` on entry (the adapter's own apply); on exit restore what was before."""
        previous = self._config
        apply(*args, **kwargs)
        try:
            yield
        finally:
            if previous is None:
                self.remove()
            else:
                self.apply(previous)


__all__ = ["MISSING", "PATCH_MARKER", "AttributePatches", "PatchLifecycle", "PatchSwitch", "VersionGuard", "is_patched",
           "unwrap"]

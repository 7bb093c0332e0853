"""The one patch lifecycle of the plugin: class-level replacements, restored by identity.

Three pieces, used by every adapter (``mcore``, ``hf``), the dispatcher fixes, the inference top-k
override and the CPU runtime:

- :class:`AttributePatches`: an ordered record of ``(owner, name, original)``. :meth:`wrap`
  builds the replacement from the *stock* object (any earlier elastic wrapper is unwrapped first,
  so a second copy of this package, e.g. ms-swift importing the plugin file under a hashed module
  name, never stacks a patch on a patch), marks it (``__elastic_moe_patched__``, ``__wrapped__``)
  and remembers the stock object. :meth:`set` redirects an attribute and remembers what was there.
  :meth:`restore` puts the originals back by identity, in reverse order, and deletes attributes
  that did not exist before. :meth:`when_imported` defers an install to the import of the module
  that holds the target (a module the training script imports later), through the package's one
  import hook (:mod:`.import_hooks`).
- :class:`PatchSwitch`: on / off for a patch without a config (the CPU runtime, the explicit-spec
  routers' dispatcher fixes, the ``training_log`` hook): idempotent, a failed install rolls back,
  off restores by identity.
- :class:`PatchLifecycle`: ``apply(config)`` / ``remove()`` / ``patched(config)`` for one
  framework. One re-entrant lock (a failed ``apply(config, model=...)`` re-applies the previous
  config while holding it), the framework's version guard on every apply, idempotence (the same
  config again changes nothing), and a generation number that routers key their cached plans on.

An adapter supplies only its version guard (:class:`~.versions.VersionGuard`, re-exported here)
and an ``install(config, patches)`` function that calls :meth:`AttributePatches.wrap` for each
target.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import sys
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

from packaging.version import Version

from elastic_moe_plugin.core.config import ElasticConfig
from elastic_moe_plugin.core.import_hooks import IMPORT_HOOKS
from elastic_moe_plugin.core.versions import VersionGuard

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
        self._undo.append(IMPORT_HOOKS.after_import(module_name, install).cancel)

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


class PatchLifecycle:
    """``apply`` / ``remove`` / ``patched`` of one framework adapter.

    The state a router's forward reads on every call is two plain attributes, so reading it is an
    attribute load, not a call into this module:

    Attributes:
        config: the :class:`ElasticConfig` of the current apply, None when not applied.
        generation: incremented by every apply that changes the config; routers key their cached
            plans on it.

    Both are written only under the lock (reads take no lock: one attribute load is atomic). An
    apply writes ``config`` before it increments ``generation``, so a reader that reads
    ``generation`` first and ``config`` second never pairs a new generation with an old config (the
    other mix, an old generation with a new config, only makes a cached plan miss once).

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
        self.config: ElasticConfig | None = None
        self.generation = 0
        self._patches: AttributePatches | None = None

    # ------------------------------------------------------------------ state
    def active_config(self) -> ElasticConfig | None:
        """:attr:`config`: the config of the current apply, or None when not applied."""
        return self.config

    def is_applied(self) -> bool:
        """Whether the patch is installed."""
        return self.config is not None

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
            if self.config == config:
                return False
            self._remove_locked()
            patches = AttributePatches()
            try:
                self._install(config, patches)
            except BaseException:
                patches.restore()
                raise
            self._patches, self.config = patches, config
            self.generation += 1  # after the config: see the class docstring
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
        self._patches, self.config = None, None

    @contextlib.contextmanager
    def rollback_on_error(self) -> Iterator[None]:
        """Restore the state from before the block (applied with its config, or not) if it raises."""
        with self._lock:
            previous = self.config
            try:
                yield
            except BaseException:
                if previous is None:
                    self._remove_locked()
                elif previous != self.config:
                    self.apply(previous)
                raise

    @contextlib.contextmanager
    def patched(self, apply: Callable[..., Any], *args: Any, **kwargs: Any) -> Iterator[None]:
        """``apply(*args, **kwargs)`` on entry (the adapter's own apply); on exit restore what was before."""
        previous = self.config
        apply(*args, **kwargs)
        try:
            yield
        finally:
            if previous is None:
                self.remove()
            else:
                self.apply(previous)


__all__ = [
    "MISSING",
    "PATCH_MARKER",
    "AttributePatches",
    "PatchLifecycle",
    "PatchSwitch",
    "VersionGuard",
    "is_patched",
    "unwrap",
]

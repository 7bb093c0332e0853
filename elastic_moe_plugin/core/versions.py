"""A framework's tested version range, checked before any patch of it is installed.

:class:`VersionGuard` answers three questions for one framework (megatron-core, transformers):
which version Python will actually import (a source tree on the path wins over an installed
wheel, so the check reads the imported package, not the metadata), whether that version is in the
tested range (an environment variable overrides the refusal, with a warning), and, when refused,
what to do about it given where the imported code comes from. Kept apart from the patch lifecycle
(:mod:`.patching`), which calls :meth:`VersionGuard.check` on every apply.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import logging
import os
import sys
from collections.abc import Callable

from packaging.version import Version

from elastic_moe_plugin.core.errors import UnsupportedFrameworkError


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
                self.framework,
                described,
                self.range,
                self.override_env,
            )
            return found
        raise self.error(f"elastic-moe supports {self.framework} {self.range}, found {described}. {self.advice()}")

    def advice(self) -> str:
        """What to do about a refused version, for where the imported code comes from (:attr:`module`)."""
        tree = self.source_tree()
        if tree is None:
            return (
                f"Install a supported version (pip install '{self.framework}{self.range}'), or set "
                f"{self.override_env}=1 to try anyway."
            )
        try:
            wheel = f", ahead of the installed {self.framework} {importlib.metadata.version(self.framework)}"
        except importlib.metadata.PackageNotFoundError:
            wheel = ""
        return (
            f"The {self.module} Python imports is a source tree, {tree} (on sys.path through PYTHONPATH or the "
            f"training script's folder{wheel}), so installing a wheel would not change it: check out a release "
            f"in {self.range} there, or take the tree off the path; or set {self.override_env}=1 to try anyway."
        )

    def source_tree(self) -> str | None:
        """The folder of the imported :attr:`module` when it is not the installed distribution's own
        files (a source checkout on the path), else None (an installed wheel, or not importable)."""
        module_name = self.module
        if not module_name:
            return None
        origin = getattr(sys.modules.get(module_name), "__file__", None)
        if origin is None:
            return None
        # directories, not files: a tree of symlinks to a wheel's files is still a tree on the path
        package_dir = os.path.realpath(os.path.dirname(os.path.abspath(origin)))
        try:
            distribution = importlib.metadata.distribution(self.framework)
            installed = distribution.locate_file(os.path.join(*module_name.split("."), "__init__.py"))
            if os.path.realpath(os.path.dirname(os.path.abspath(str(installed)))) == package_dir:
                return None
        except importlib.metadata.PackageNotFoundError:
            pass
        return os.path.realpath(os.path.join(package_dir, *[".."] * len(module_name.split("."))))


__all__ = ["VersionGuard"]

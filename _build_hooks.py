"""setuptools build step: put the ms-swift start-up hook's ``.pth`` file at the root of the wheel.

A ``.pth`` file only runs when it sits directly in site-packages, which neither ``package-data``
(inside the package) nor ``data-files`` (relative to the install prefix, not site-packages)
can express. ``build_py`` therefore copies ``elastic-moe-swift.pth`` (next to this file) to the
root of the build tree; the wheel then installs it next to the package, and pip's RECORD
lists it, so ``pip uninstall elastic-moe-plugin`` removes it. What it does: docs/swift.md.
"""

from __future__ import annotations

import os

from setuptools.command.build_py import build_py as _build_py

PTH_SOURCE = "elastic-moe-swift.pth"


class build_py(_build_py):  # noqa: N801 - setuptools looks commands up by this name
    """``build_py`` that also copies :data:`PTH_SOURCE` to the root of ``build_lib``."""

    def run(self) -> None:
        super().run()
        self.copy_file(PTH_SOURCE, os.path.join(self.build_lib, os.path.basename(PTH_SOURCE)), preserve_mode=False)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, os.path.basename(PTH_SOURCE))]

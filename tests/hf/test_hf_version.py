"""The transformers version guard reads the ``transformers`` Python imports, as the Megatron one does.

``transformers.__version__`` of the imported package decides, not the installed distribution's
metadata (which a source checkout on the path lacks, or which describes another install); a refusal
says whether ``pip install`` can help: not when the imported package is a source tree that shadows
the wheel.
"""

from __future__ import annotations

import sys
import types

import pytest
from packaging.version import Version

from elastic_moe_plugin.core.errors import UnsupportedTransformersError
from elastic_moe_plugin.hf import patch as hf_patch

pytestmark = pytest.mark.hf


def test_the_version_is_the_imported_modules(monkeypatch):
    import importlib.metadata

    import transformers

    assert hf_patch.transformers_version() == Version(transformers.__version__)
    monkeypatch.setattr(transformers, "__version__", "5.99.0")  # the metadata still says the wheel's
    assert hf_patch.transformers_version() == Version("5.99.0") != Version(importlib.metadata.version("transformers"))
    monkeypatch.delenv(hf_patch.ALLOW_UNSUPPORTED_ENV, raising=False)
    with pytest.raises(UnsupportedTransformersError, match=r"found 5\.99\.0\. Install a supported version"):
        hf_patch.check_transformers_version()


def test_a_source_tree_on_the_path_is_named_and_not_told_to_pip_install(tmp_path, monkeypatch):
    tree = tmp_path / "transformers-checkout" / "src"
    (tree / "transformers").mkdir(parents=True)
    (tree / "transformers" / "__init__.py").write_text("__version__ = '5.99.0.dev0'\n")
    shadow = types.ModuleType("transformers")
    shadow.__file__ = str(tree / "transformers" / "__init__.py")
    shadow.__version__ = "5.99.0.dev0"
    monkeypatch.setitem(sys.modules, "transformers", shadow)
    monkeypatch.delenv(hf_patch.ALLOW_UNSUPPORTED_ENV, raising=False)
    tree = tree.resolve()
    assert hf_patch.VERSION_GUARD.source_tree() == str(tree)
    with pytest.raises(UnsupportedTransformersError) as caught:
        hf_patch.check_transformers_version()
    message = str(caught.value)
    assert f"The transformers Python imports is a source tree, {tree}" in message and "pip install" not in message
    assert f"{hf_patch.ALLOW_UNSUPPORTED_ENV}=1 to try anyway" in message

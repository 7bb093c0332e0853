"""The version guard reads the ``megatron.core`` that Python imports, in every layout users run.

Each layout is a real one, in a subprocess (the pytest process has imported megatron.core already):

- a Megatron-LM source tree on ``PYTHONPATH`` and no installed megatron-core at all (how
  Megatron-LM's own examples run): the interpreter starts with ``-S`` on a copy of site-packages
  without megatron, so ``importlib.metadata`` finds no distribution;
- a megatron-core wheel installed *and* a newer source tree first on the path: the tree's version
  is what counts, so it is refused;
- the same with ``ELASTIC_MOE_ALLOW_UNSUPPORTED_MCORE=1``: applied, with a warning.

The source trees are the imported megatron.core's own files (symlinked), with ``package_info.py``
rewritten where a test needs another version.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from packaging.version import Version

import elastic_moe_plugin
from elastic_moe_plugin.core.errors import UnsupportedMegatronError
from elastic_moe_plugin.core.patching import VersionGuard

pytestmark = [pytest.mark.megatron]

PACKAGE_ROOT = Path(elastic_moe_plugin.__file__).resolve().parents[1]

PROBE = r"""
import importlib.metadata, json, logging
from elastic_moe_plugin import cpu_runtime

cpu_runtime.disable_torch_compile()
cpu_runtime.enable(force=True)  # megatron-core 0.19 imports a triton-only module
import megatron.core
from elastic_moe_plugin import ElasticConfig, mcore

warnings = []
logging.getLogger("elastic_moe_plugin").addHandler(type("H", (logging.Handler,), {"emit": lambda self, r: warnings.append(r.getMessage())})())
try:
    metadata = importlib.metadata.version("megatron-core")
except importlib.metadata.PackageNotFoundError:
    metadata = None
result = {"core_file": megatron.core.__file__, "metadata": metadata, "read": str(mcore.megatron_core_version())}
try:
    mcore.apply(ElasticConfig(schedule="1-3"))
    result["applied"] = mcore.is_applied()
except Exception as error:
    result["error"] = f"{type(error).__name__}: {error}"
result["warnings"] = warnings
print("PROBE", json.dumps(result))
"""


def _imported_core_dir() -> Path:
    import megatron.core

    return Path(megatron.core.__file__).resolve().parent


def _source_tree(root: Path, version: str | None = None) -> Path:
    """``root/megatron/core``: the imported megatron.core's files, symlinked; no package metadata.
    With ``version``, ``package_info.py`` is a real file declaring it. Returns ``root``.

    The byte-code caches come along (a symlinked source has its target's mtime and size, so the
    cached code is valid; a probe would otherwise compile megatron.core from source): the folders
    are real, so a cache Python writes for ``package_info.py`` replaces a link here, not the file."""
    core = root / "megatron" / "core"
    shutil.copytree(_imported_core_dir(), core, copy_function=os.symlink)
    if version is not None:
        info = core / "package_info.py"
        text = info.read_text()
        info.unlink()
        major, minor, patch = version.split(".")
        for name, value in (("MAJOR", major), ("MINOR", minor), ("PATCH", patch)):
            text = re.sub(rf"^{name} = \d+$", f"{name} = {value}", text, count=1, flags=re.MULTILINE)
        info.write_text(text)
    return root


def _site_packages_without_megatron(root: Path) -> Path:
    """A directory of symlinks to every entry of torch's site-packages except megatron's own."""
    site = Path(torch.__file__).resolve().parents[1]
    root.mkdir()
    for entry in site.iterdir():
        if entry.name == "megatron" or entry.name.startswith(("megatron_core", "megatron-core")):
            continue
        (root / entry.name).symlink_to(entry)
    return root


def _start(*, path: list[Path], isolated: bool, **env: str) -> subprocess.Popen:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_MOE_") and k != "PYTHONPATH"}
    environ.update(PYTHONPATH=os.pathsep.join(str(p) for p in path), NO_VCS_VERSION="1", **env)
    command = [sys.executable, *(["-S"] if isolated else []), "-c", PROBE]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environ)


def _result(process: subprocess.Popen) -> dict:
    out, _ = process.communicate(timeout=300)
    found = [line for line in out.splitlines() if line.startswith("PROBE ")]
    assert process.returncode == 0 and found, f"probe failed (exit {process.returncode}):\n{out[-4000:]}"
    return json.loads(found[-1][len("PROBE "):])


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """The three probes, started together (each imports megatron.core: a few seconds)."""
    import megatron.core

    tmp = tmp_path_factory.mktemp("layouts")
    imported = Version(megatron.core.__version__).base_version
    plain = _source_tree(tmp / "plain")
    newer = _source_tree(tmp / "newer", "0.20.0")
    site = _site_packages_without_megatron(tmp / "site")
    running = {
        "plain_tree_no_metadata": _start(path=[PACKAGE_ROOT, plain, site], isolated=True),
        "wheel_plus_newer_tree": _start(path=[PACKAGE_ROOT, newer], isolated=False),
        "wheel_plus_newer_tree_overridden": _start(path=[PACKAGE_ROOT, newer], isolated=False,
                                                   ELASTIC_MOE_ALLOW_UNSUPPORTED_MCORE="1"),
    }
    results = {name: _result(process) for name, process in running.items()}
    return imported, tmp, results


@pytest.mark.slow  # a subprocess that imports megatron.core
def test_a_source_tree_without_package_metadata_is_read_and_patched(layouts):
    imported, tmp, results = layouts
    result = results["plain_tree_no_metadata"]
    assert result["core_file"].startswith(str(tmp / "plain")), result
    assert result["metadata"] is None, "the layout must have no megatron-core distribution"
    assert Version(result["read"]).base_version == imported
    assert result.get("applied") is True, result


@pytest.mark.slow  # a subprocess that imports megatron.core
def test_a_newer_source_tree_before_a_wheel_is_refused(layouts):
    _, tmp, results = layouts
    result = results["wheel_plus_newer_tree"]
    assert result["core_file"].startswith(str(tmp / "newer")), result
    assert result["metadata"] is not None and Version(result["metadata"]) < Version("0.20"), \
        "the wheel's metadata must still say a supported version"
    assert result["read"] == "0.20.0"
    assert "applied" not in result
    assert result["error"].startswith("UnsupportedMegatronError") and "found 0.20.0" in result["error"]
    assert "ELASTIC_MOE_ALLOW_UNSUPPORTED_MCORE=1" in result["error"]


@pytest.mark.slow  # a subprocess that imports megatron.core
def test_the_override_accepts_the_newer_source_tree(layouts):
    _, _, results = layouts
    result = results["wheel_plus_newer_tree_overridden"]
    assert result["read"] == "0.20.0" and result.get("applied") is True, result
    assert any("0.20.0 is outside the tested range" in w and "trying anyway" in w for w in result["warnings"])


# -------------------------------------------------------------------- the guard itself (no framework)
GUARD = VersionGuard("megatron-core", Version("0.16"), Version("0.20"), "ELASTIC_MOE_TEST_OVERRIDE",
                     UnsupportedMegatronError, extra="megatron")


def test_an_unknown_version_is_refused_unless_overridden(monkeypatch):
    monkeypatch.delenv("ELASTIC_MOE_TEST_OVERRIDE", raising=False)
    with pytest.raises(UnsupportedMegatronError, match=r"found an unknown version.*ELASTIC_MOE_TEST_OVERRIDE=1"):
        GUARD.check(lambda: None)
    monkeypatch.setenv("ELASTIC_MOE_TEST_OVERRIDE", "1")
    assert GUARD.check(lambda: None) is None
    assert GUARD.check(lambda: Version("0.21.0")) == Version("0.21.0")


def test_a_local_version_label_counts_as_its_release():
    assert GUARD.check(lambda: Version("0.19.2+8fe19ed")) == Version("0.19.2+8fe19ed")


@pytest.mark.slow  # a subprocess that imports megatron.core
def test_the_advice_for_a_source_tree_is_not_to_install_a_wheel(layouts):
    """The refused version comes from a tree on the path that shadows the installed wheel: installing
    cannot help, and the message says so and where the tree is."""
    _, tmp, results = layouts
    error = results["wheel_plus_newer_tree"]["error"]
    assert f"is a source tree, {tmp / 'newer'}" in error and "installing a wheel would not change it" in error
    assert "ahead of the installed megatron-core" in error and "pip install" not in error


def test_the_advice_for_an_installed_wheel_is_to_install_a_supported_one(monkeypatch):
    guard = dataclasses.replace(GUARD, module="megatron.core")
    if guard.source_tree() is not None:
        pytest.skip("the imported megatron.core is a source tree here")
    monkeypatch.delenv("ELASTIC_MOE_TEST_OVERRIDE", raising=False)
    with pytest.raises(UnsupportedMegatronError, match=r"found 0\.21\.0\. Install a supported version \(pip install "
                                                       r"'megatron-core>=0\.16,<0\.20'\)"):
        guard.check(lambda: Version("0.21.0"))

"""Shared test settings and the installed-wheel fixture.

Megatron-core's ``jit_fuser`` wraps a few functions in ``torch.compile``; on CPU the first call
costs ~14 s of inductor compile per process, so tests run with compile disabled (the Makefile
exports the same variable).

``wheel_venv`` (session): the wheel built from this checkout, installed non-editable into a fresh
venv, as ``pip install elastic-moe-plugin`` gives it to a user (used by ``tests/test_packaging.py``
and ``tests/swift/test_swift_wheel.py``).

``op_counter`` / ``count_host_syncs``: the one op counter of the suite (``tests/counters.py``).
"""

import importlib.metadata
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

from counters import count_host_syncs, op_counter  # noqa: F401 - the op-counter fixtures (tests/counters.py)

os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def wheel_venv(tmp_path_factory) -> dict:
    """{'python', 'bin', 'site', 'cwd', 'wheel'} of a fresh venv holding the wheel built from this checkout.

    The wheel is built with ``pip wheel`` without build isolation (this venv's setuptools, nothing
    downloaded). The fresh venv sees the frameworks of the test venv (torch, transformers, ms-swift,
    megatron-core) through a ``.pth`` *path entry*, which does not run the test venv's own ``.pth``
    hooks, so the editable install of the checkout stays invisible. ms-swift's console scripts
    (``swift``, ``megatron``) are written into the fresh venv from ms-swift's own entry points, as
    pip writes them when it installs ms-swift there. ``cwd`` is a folder outside the checkout.
    """
    work = tmp_path_factory.mktemp("wheel")
    dist = work / "dist"
    # setuptools builds in the source tree; leave no build/ or egg-info behind (a stray egg-info on
    # sys.path would pass for an installed distribution)
    leftovers = [path for path in (REPO / "build", REPO / "elastic_moe_plugin.egg-info") if not path.exists()]
    try:
        build = subprocess.run([sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "--no-build-isolation",
                                "-q", "-w", str(dist)], cwd=work, capture_output=True, text=True)
    finally:
        for path in leftovers:
            shutil.rmtree(path, ignore_errors=True)
    assert build.returncode == 0, build.stderr
    wheels = list(dist.glob("elastic_moe_plugin-*.whl"))
    assert len(wheels) == 1, wheels
    env_dir = work / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    # the test venv's packages as a plain path entry (its .pth hooks, the editable finder among them, do not run)
    (site / "_test_venv_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # the fresh interpreter runs pip (seen through the path entry), so the console script's shebang is its own;
    # --ignore-installed: pip must not uninstall the test venv's editable install it also sees there
    subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed", "-q",
                    str(wheels[0])], check=True, capture_output=True, text=True)
    try:
        scripts = [ep for ep in importlib.metadata.distribution("ms-swift").entry_points if ep.group == "console_scripts"]
    except importlib.metadata.PackageNotFoundError:
        scripts = []
    for entry in scripts:
        script = env_dir / "bin" / entry.name
        script.write_text(f"#!{python}\nimport sys\nfrom {entry.module} import {entry.attr}\n"
                          f"if __name__ == '__main__':\n    sys.exit({entry.attr}())\n")
        script.chmod(0o755)
    outside = work / "elsewhere"
    outside.mkdir()
    return {"python": str(python), "bin": env_dir / "bin", "site": site, "cwd": outside, "wheel": wheels[0]}

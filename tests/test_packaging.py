"""What ``pip install elastic-moe-plugin`` gives a user: a non-editable wheel, run outside any checkout.

The wheel is built from this checkout (``pip wheel``, no build isolation: the build uses this
venv's setuptools, so nothing is downloaded) and installed into a fresh venv. The fresh venv sees
the frameworks (torch, megatron-core, transformers, ...) of the test venv through a ``.pth`` path
entry, which does *not* run the test venv's own ``.pth`` hooks, so the editable install of the
checkout stays invisible: every command below runs the wheel's copy, from a folder outside the
checkout. Checked:

- the package, its recipes, evaluation suites and ms-swift plugin file import/resolve from the
  fresh venv's site-packages;
- ``elastic-moe launch olmoe_sft/6-10 --dry-run`` (rendering ``--plugin elastic_moe``), ``launch
  --list``, ``elastic-moe budget pretrain/6-10``, ``elastic-moe recipes``, the built-in ``avg9``
  suite and ``elastic-moe plugin-path`` work;
- the ms-swift start-up hook's ``.pth`` lands at the root of site-packages, byte-identical to the
  checkout's, listed in the wheel's RECORD, and ``pip uninstall`` removes it (in a second venv).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(wheel_venv) -> dict:
    return wheel_venv


def _run(installed: dict, *argv: str) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(TORCH_COMPILE_DISABLE="1", PATH=f"{installed['bin']}{os.pathsep}{env.get('PATH', '')}")
    return subprocess.run(list(argv), cwd=installed["cwd"], env=env, capture_output=True, text=True, timeout=600)


def test_the_wheel_not_the_checkout_is_imported(installed):
    probe = (
        "import json, elastic_moe_plugin, elastic_moe_plugin.tools as tools;"
        "from elastic_moe_plugin.swift import plugin_path;"
        "print(json.dumps({'package': elastic_moe_plugin.__file__, 'configs': str(tools.PACKAGE_CONFIGS_DIR),"
        " 'plugin': str(plugin_path())}))"
    )
    result = _run(installed, installed["python"], "-c", probe)
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    for key in ("package", "configs", "plugin"):
        assert Path(found[key]).resolve().is_relative_to(installed["site"].resolve()), (key, found[key])
    assert not Path(found["package"]).resolve().is_relative_to(REPO)
    configs = Path(found["configs"])
    assert sorted(p.name for p in configs.iterdir()) == ["eval", "olmoe_sft", "overlays", "pretrain", "pretrain_titan",
                                                         "qwen3_sft"]
    assert len(list(configs.glob("*/*.yaml"))) == len(list((REPO / "elastic_moe_plugin" / "configs").glob("*/*.yaml")))
    plugin = Path(found["plugin"])
    assert plugin.is_file() and [p.name for p in plugin.parent.glob("*.py")] == ["elastic_moe.py"]


def test_recipes_resolve_by_name_from_the_installed_package(installed):
    listing = _run(installed, "elastic-moe", "recipes")
    assert listing.returncode == 0, listing.stderr
    assert "olmoe_sft/6-10" in listing.stdout and "pretrain/6-10" in listing.stdout and "qwen3_sft/6-10" in listing.stdout

    launch = _run(installed, "elastic-moe", "launch", "olmoe_sft/6-10", "--dry-run", "--nnodes", "2",
                  "--nproc-per-node", "8", "--node-rank", "0", "--master-addr", "node0")
    assert launch.returncode == 0, launch.stderr
    assert "ELASTIC_MOE_SCHEDULE=6-10" in launch.stdout and "swift sft" in launch.stdout
    # the installed start-up hook makes the one-flag form work: the command uses it
    command_lines = [line for line in launch.stdout.splitlines() if not line.startswith("#")]
    assert "  --plugin elastic_moe" in command_lines and not any("--external_plugins" in line for line in command_lines)
    assert "# the plugin: --plugin elastic_moe" in launch.stdout
    listing = _run(installed, "elastic-moe", "launch", "--list")
    assert listing.returncode == 0 and "olmoe_sft/6-10" in listing.stdout and "44 recipes" in listing.stdout

    budget = _run(installed, "elastic-moe", "budget", "pretrain/6-10")
    assert budget.returncode == 0, budget.stderr
    assert "C = M * D = 6.0383e+19 FLOPs (paper: 6.0e+19, +0.6%)" in budget.stdout


def test_the_builtin_suite_resolves_from_the_installed_package(installed):
    probe = (
        "import json; from elastic_moe_plugin.tools.eval.suite import BUILTIN_SUITE_DIR, builtin_suites, load_suite;"
        "suite = load_suite('avg9');"
        "print(json.dumps({'dir': str(BUILTIN_SUITE_DIR), 'names': builtin_suites(), 'tasks': len(suite.tasks)}))"
    )
    result = _run(installed, installed["python"], "-c", probe)
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    assert Path(found["dir"]).resolve().is_relative_to(installed["site"].resolve())
    assert found["names"] == ["avg9", "pretrain11"] and found["tasks"] == 9
    helptext = _run(installed, "elastic-moe", "eval", "--help")
    assert helptext.returncode == 0 and "avg9" in helptext.stdout


def test_plugin_path_prints_the_installed_file(installed):
    result = _run(installed, "elastic-moe", "plugin-path")
    assert result.returncode == 0, result.stderr
    path = Path(result.stdout.strip())
    assert path.is_file() and path.name == "elastic_moe.py"
    assert path.resolve().is_relative_to(installed["site"].resolve())
    assert "from elastic_moe_plugin.swift import install" in path.read_text()


def test_the_start_up_hook_is_installed_at_the_root_of_site_packages(installed):
    pth = installed["site"] / "elastic-moe-swift.pth"
    assert pth.read_bytes() == (REPO / "elastic-moe-swift.pth").read_bytes()
    record = next(installed["site"].glob("elastic_moe_plugin-*.dist-info")) / "RECORD"
    assert any(line.startswith("elastic-moe-swift.pth,") for line in record.read_text().splitlines())
    # nowhere else: a copy inside the package would never run and only confuse
    assert [p.name for p in installed["site"].rglob("*.pth") if "elastic" in p.name] == ["elastic-moe-swift.pth"]
    probe = "from elastic_moe_plugin.swift.plugin_flag import hook_installed; print(hook_installed())"
    assert _run(installed, installed["python"], "-c", probe).stdout.strip() == "True"


def test_pip_uninstall_removes_the_start_up_hook(tmp_path, installed):
    """In a venv of its own with its own pip (ensurepip, offline) and nothing else visible: pip must
    never see, and so never touch, another environment's install of the package."""
    import venv

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = str(env_dir / "bin" / "python")
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV", "PIP_TARGET")}
    site = Path(subprocess.run([python, "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True, env=env).stdout.strip())
    # -I: no PYTHONPATH, no user site, no current directory: pip sees this venv only
    pip = [python, "-I", "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "install", "--no-deps", "--no-index", str(installed["wheel"])], check=True,
                   capture_output=True, text=True, cwd=tmp_path, env=env)
    assert (site / "elastic-moe-swift.pth").is_file()
    subprocess.run([*pip, "uninstall", "-y", "elastic-moe-plugin"], check=True, capture_output=True, text=True,
                   cwd=tmp_path, env=env)
    assert not (site / "elastic-moe-swift.pth").exists() and not (site / "elastic_moe_plugin").exists()

"""The ``--plugin`` start-up hook (``elastic_moe_plugin.swift.plugin_flag``), unit by unit.

The end-to-end runs (a real ``swift sft --plugin elastic_moe`` from the installed wheel, torchrun
with two ranks, the off switch, an unknown name) are in ``test_swift_wheel.py``; the runs from the
checkout in ``test_swift_sft.py``. Here: which processes the hook acts in, the argv rewrite of
every accepted form, stepping aside for an ms-swift that parses ``--plugin`` itself (a copy of the
installed ms-swift with such a field added), and what a process with ``ELASTIC_MOE_*`` but no
plugin hears.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_moe_plugin.swift import PLUGIN_FILE
from elastic_moe_plugin.swift.plugin_flag import PluginFlagError, rewrite, swift_entry, swift_handles_plugins

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = str(PLUGIN_FILE)


def _swift_dir() -> Path:
    import importlib.util

    return Path(importlib.util.find_spec("swift").submodule_search_locations[0])


# ------------------------------------------------------------------------------- which processes
def test_only_ms_swift_entry_scripts_are_entries():
    swift = _swift_dir()
    sft = swift_entry([str(swift / "cli" / "sft.py"), "--model", "m"], [])
    assert (sft.route, sft.megatron, Path(sft.swift_dir)) == ("sft", False, swift)
    megatron = swift_entry([str(swift / "cli" / "_megatron" / "sft.py")], [])
    assert (megatron.route, megatron.megatron) == ("sft", True)
    by_module = swift_entry(["-m", "--model", "m"], [sys.executable, "-m", "swift.cli.sft", "--model", "m"])
    assert by_module.route == "sft" and Path(by_module.swift_dir) == swift
    for argv, orig in [
        ([str(swift / "cli" / "main.py"), "sft"], []),                      # the launcher module itself
        ([str(Path(sys.executable).with_name("swift")), "sft"], []),         # the `swift` console script
        (["-m", "2"], [sys.executable, "-m", "torch.distributed.run", "2"]),  # the torchrun agent
        (["-c"], [sys.executable, "-c", "import swift"]),
        (["/home/me/swift/cli/train.py"], []),                               # not ms-swift's package
        ([], []),
    ]:
        assert swift_entry(argv, orig) is None, argv


# ------------------------------------------------------------------------------- the rewrite
@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--model", "m", "--plugin", "elastic_moe", "--max_steps", "3"],
         ["--model", "m", "--external_plugins", PLUGIN, "--callbacks", "elastic_moe", "--max_steps", "3"]),
        (["--plugin=elastic_moe", "--model", "m"],
         ["--external_plugins", PLUGIN, "--callbacks", "elastic_moe", "--model", "m"]),
        (["--external_plugins", "elastic_moe"], ["--external_plugins", PLUGIN, "--callbacks", "elastic_moe"]),
        # merged into the flags the command already has (ms-swift keeps the last occurrence)
        (["--external_plugins", "mine.py", "--plugin", "elastic_moe", "--callbacks", "early_stop"],
         ["--external_plugins", "mine.py", PLUGIN, "--callbacks", "early_stop", "elastic_moe"]),
        (["--plugin", "elastic_moe", "--callbacks", "elastic_moe"],
         ["--external_plugins", PLUGIN, "--callbacks", "elastic_moe"]),
        (["--plugin", "elastic_moe", "--external_plugins", PLUGIN],
         ["--external_plugins", PLUGIN, "--callbacks", "elastic_moe"]),
        # no plugin named: untouched, whatever else is there (the path form is left as typed)
        (["--external_plugins", PLUGIN, "--model", "m"], ["--external_plugins", PLUGIN, "--model", "m"]),
        (["--model", "m"], ["--model", "m"]),
    ],
)
def test_rewrite(argv, expected):
    assert rewrite(argv, "sft").argv == expected


def test_routes_without_callbacks_get_only_the_file():
    assert rewrite(["--plugin", "elastic_moe", "--ckpt_dir", "c"], "infer").argv == [
        "--external_plugins", PLUGIN, "--ckpt_dir", "c"]


@pytest.mark.parametrize(("argv", "message"), [
    (["--plugin", "nosuch"], "--plugin 'nosuch': no such plugin. Known plugins: elastic_moe (Elastic Expert Routing"),
    (["--plugin=elastic-moe"], "--plugin 'elastic-moe': no such plugin. Known plugins: elastic_moe"),
    (["--external_plugins", "nosuch"], "--external_plugins 'nosuch': no such plugin. Known plugins: elastic_moe"),
    (["--plugin", "--model", "m"], "--plugin needs a plugin name, e.g. --plugin elastic_moe"),
])
def test_unknown_names_list_the_known_plugins(argv, message):
    with pytest.raises(PluginFlagError, match="^" + message.replace("(", r"\(")):
        rewrite(argv, "sft")


# ------------------------------------------------------------------------------- stepping aside
#: where ms-swift 4.6 declares its arguments and loads plugin files (relative to the ``swift``
#: package): the files ``swift_handles_plugins`` reads (its docstring)
SWIFT_PLUGIN_SOURCES = ("arguments/base_args/base_args.py", "megatron/arguments/megatron_args.py", "utils/utils.py")


def _swift_copy(tmp_path: Path, *, add_to_base_args: str = "") -> Path:
    """A copy of the installed ms-swift's files the hook reads, with ``add_to_base_args`` appended
    to ``BaseArguments``' source (what a future ms-swift with its own --plugin would declare)."""
    swift = _swift_dir()
    copy = tmp_path / "swift"
    for relative in ("cli/main.py", "cli/sft.py", *SWIFT_PLUGIN_SOURCES):
        (copy / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(swift / relative, copy / relative)
    if add_to_base_args:
        base_args = copy / "arguments/base_args/base_args.py"
        text = base_args.read_text()
        marker = "    external_plugins: List[str] = field(default_factory=list)\n"
        assert marker in text
        base_args.write_text(text.replace(marker, marker + add_to_base_args))
    return copy


def test_the_installed_ms_swift_has_no_plugin_flag_of_its_own():
    assert swift_handles_plugins(str(_swift_dir())) is None


@pytest.mark.parametrize("declaration", [
    "    plugin: Optional[str] = None\n",
    "    plugins: List[str] = field(default_factory=list)\n",
])
def test_an_ms_swift_with_its_own_plugin_argument_is_left_alone(tmp_path, declaration):
    copy = _swift_copy(tmp_path, add_to_base_args=declaration)
    reason = swift_handles_plugins(str(copy))
    assert reason is not None and "ms-swift declares its own argument 'plugin" in reason
    # in a process of that ms-swift, the hook leaves --plugin as typed
    result = _activate_in_entry(copy, ["--plugin", "elastic_moe", "--model", "m"])
    assert result["argv"] == ["--plugin", "elastic_moe", "--model", "m"], result
    assert "leaving --plugin to ms-swift" in result["stderr"]


def test_an_ms_swift_with_a_plugin_registry_is_left_alone(tmp_path):
    copy = _swift_copy(tmp_path)
    utils = copy / "utils/utils.py"
    utils.write_text(utils.read_text() + "\n\ndef _load_plugins():\n    return importlib.metadata.entry_points("
                     "group='swift.plugins')\n")
    assert "entry points" in swift_handles_plugins(str(copy))
    assert _activate_in_entry(copy, ["--plugin", "elastic_moe"])["argv"] == ["--plugin", "elastic_moe"]


def _activate_in_entry(swift_dir: Path, arguments: list[str], env: dict[str, str] | None = None,
                       route: str = "sft") -> dict:
    """Run :func:`plugin_flag.activate` in a fresh interpreter whose ``sys.argv`` is that of
    ``swift_dir``'s ``cli/sft.py`` entry script (as the ``.pth`` line sees it); returns the
    rewritten arguments, the exit status and stderr."""
    code = (
        "import json, sys\n"
        f"sys.argv[:] = [{str(swift_dir / 'cli' / f'{route}.py')!r}, *json.loads(sys.argv[1])]\n"
        "from elastic_moe_plugin.swift import plugin_flag\n"
        "plugin_flag.activate()\n"
        "print(json.dumps(sys.argv[1:]))\n"
    )
    import json

    environ = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_MOE_")}
    environ.update(env or {})
    result = subprocess.run([sys.executable, "-c", code, json.dumps(arguments)], capture_output=True, text=True,
                            env=environ, timeout=120)
    argv = json.loads(result.stdout.strip().splitlines()[-1]) if result.returncode == 0 else None
    return {"argv": argv, "returncode": result.returncode, "stderr": result.stderr}


def test_the_off_switch_leaves_every_argument_to_ms_swift():
    result = _activate_in_entry(_swift_dir(), ["--plugin", "elastic_moe"], {"ELASTIC_MOE_SWIFT_HOOK": "0"})
    assert result["argv"] == ["--plugin", "elastic_moe"] and result["stderr"] == ""


def test_an_unknown_name_exits_2_before_anything_runs():
    result = _activate_in_entry(_swift_dir(), ["--plugin", "nosuch"])
    assert result["returncode"] == 2
    assert result["stderr"].startswith("elastic-moe: error: --plugin 'nosuch': no such plugin. Known plugins: elastic_moe")


def test_elastic_moe_variables_without_the_plugin_warn():
    result = _activate_in_entry(_swift_dir(), ["--model", "m"], {"ELASTIC_MOE_SCHEDULE": "6-10"})
    assert result["argv"] == ["--model", "m"]
    assert "WARNING: ELASTIC_MOE_SCHEDULE set, but no elastic-moe plugin is loaded: this run trains plain top-k" in result["stderr"]
    # loaded through the checkout's plugin file: no warning; on another rank than 0: no warning either
    loaded = _activate_in_entry(_swift_dir(), ["--external_plugins", str(ROOT / "patches" / "elastic_moe.py")],
                                {"ELASTIC_MOE_SCHEDULE": "6-10"})
    assert loaded["stderr"] == ""
    other_rank = _activate_in_entry(_swift_dir(), ["--model", "m"], {"ELASTIC_MOE_SCHEDULE": "6-10", "RANK": "1"})
    assert other_rank["stderr"] == ""
    # `swift infer --ckpt_dir` re-imports the plugins saved with the checkpoint: nothing to warn about
    infer = _activate_in_entry(_swift_dir(), ["--ckpt_dir", "c"], {"ELASTIC_MOE_SCHEDULE": "6-10"}, route="infer")
    assert infer["argv"] == ["--ckpt_dir", "c"] and infer["stderr"] == ""


def test_the_pth_line_imports_nothing_outside_swift(tmp_path):
    """The shipped ``.pth`` line, run by ``site`` for a plain ``python -c``: no module of the package
    (nor torch) is imported; for a ms-swift entry script it imports the hook."""
    line = [text for text in (ROOT / "elastic-moe-swift.pth").read_text().splitlines() if text.startswith("import ")]
    assert len(line) == 1
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    shutil.copy(ROOT / "elastic-moe-swift.pth", site_dir / "elastic-moe-swift.pth")
    probe = ("import site, sys; site.addsitedir(sys.argv[1]); "
             "print(sorted(m for m in sys.modules if m.startswith(('elastic_moe_plugin', 'torch'))))")
    result = subprocess.run([sys.executable, "-c", probe, str(site_dir)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
    # a user's script whose path mentions swift, outside ms-swift's swift/cli/: nothing either
    script = tmp_path / "swift_jobs" / "swift_eval.py"
    script.parent.mkdir()
    script.write_text(probe.replace("sys.argv[1]", repr(str(site_dir))))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_hook_imports_no_torch_in_an_entry_process():
    """In ms-swift's entry process the hook runs before anything; it must not pull torch (or the
    package's core) in itself."""
    code = (
        "import json, sys\n"
        f"sys.argv[:] = [{str(_swift_dir() / 'cli' / 'sft.py')!r}, '--plugin', 'elastic_moe']\n"
        "from elastic_moe_plugin.swift import plugin_flag\n"
        "plugin_flag.activate()\n"
        "print(json.dumps(sorted(m for m in sys.modules if m == 'torch' or m.startswith('elastic_moe_plugin.core'))))\n"
    )
    environ = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_MOE_")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environ, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"

#!/usr/bin/env python3
"""What the ms-swift start-up hook (``elastic-moe-swift.pth``) costs, measured, not asserted.

    python scripts/measure_hook_cost.py [--runs 20] [--json]

Builds the wheel from this checkout and two fresh venvs that differ only in it: ``bare`` (no
plugin) and ``wheel`` (the wheel installed non-editable). Both see this interpreter's packages
(torch, ms-swift, ...) through the same ``.pth`` path entry. Then, alternating bare/wheel runs so
that machine load hits both alike, the median wall time of:

1. ``python -c pass``: any Python process that is not ms-swift (the ``.pth`` line compares strings
   and imports nothing);
2. ``python -c 'import json'`` run as ``.../bin/swift``-like processes is not needed: the launcher
   case is (3) with ``sys.argv[0]`` the ``swift`` console script;
3. the hook's work inside ms-swift's entry process (``swift/cli/sft.py --plugin elastic_moe ...``):
   the ``.pth`` line executed in a fresh interpreter whose ``sys.argv`` is that process's, timed
   from inside (import of the hook + the argv rewrite), and the same for the ``swift`` launcher
   process (the hook imports, sees a launcher and returns).

(3) is what ``swift sft`` pays on top of its own start-up (several seconds of imports); a full
``swift sft`` run is too noisy to show a difference of that size.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import venv
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _make_venv(root: Path, wheel: Path | None) -> Path:
    venv.EnvBuilder(with_pip=False).create(root)
    python = root / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    if wheel is not None:
        subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed", "-q",
                        str(wheel)], check=True, capture_output=True, text=True)
    return python


def _clean_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV") and not k.startswith("ELASTIC_MOE_")}


def _wall(argv: list[str], cwd: Path) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True, cwd=cwd, env=_clean_env(), stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


#: standard-library modules ms-swift's entry process imports anyway (torch and swift import them
#: within its first milliseconds): preloaded, the hook's time is what it adds to that process
PRELOADED = ("typing", "logging", "pathlib", "dataclasses", "re", "importlib.util", "json", "inspect")

_INSIDE = """
import sys, time
for name in {preload!r}:
    __import__(name)
sys.argv[:] = [{argv0!r}, "--plugin", "elastic_moe", "--model", "m"]
line = [l for l in open({pth!r}) if l.startswith("import ")][0]
start = time.perf_counter()
exec(line)
elapsed = time.perf_counter() - start
assert ("--external_plugins" in sys.argv) == {expect_rewrite!r}, sys.argv
print(elapsed)
"""


def _inside(python: Path, pth: Path, argv0: str, expect_rewrite: bool, cwd: Path, preload: tuple = ()) -> float:
    code = _INSIDE.format(argv0=argv0, pth=str(pth), expect_rewrite=expect_rewrite, preload=preload)
    out = subprocess.run([str(python), "-S", "-c", code], check=True, cwd=cwd, env=_clean_env(),
                         capture_output=True, text=True).stdout
    return float(out.strip())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    import importlib.util

    swift_spec = importlib.util.find_spec("swift")
    work = Path(tempfile.mkdtemp(prefix="hook_cost_"))
    try:
        subprocess.run([sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(work / "dist")], check=True, capture_output=True, text=True, cwd=work)
        for leftover in (REPO / "build", REPO / "elastic_moe_plugin.egg-info"):
            shutil.rmtree(leftover, ignore_errors=True)
        wheel = next((work / "dist").glob("*.whl"))
        pythons = {"bare": _make_venv(work / "bare", None), "wheel": _make_venv(work / "wheel", wheel)}
        site = Path(subprocess.run([str(pythons["wheel"]), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   check=True, capture_output=True, text=True).stdout.strip())
        pth = site / "elastic-moe-swift.pth"
        assert pth.is_file(), pth
        times: dict[str, dict[str, list[float]]] = {"python -c pass": {"bare": [], "wheel": []}}
        for _ in range(3):  # warm the page cache
            for python in pythons.values():
                _wall([str(python), "-c", "pass"], work)
        for _ in range(args.runs):
            for name, python in pythons.items():
                times["python -c pass"][name].append(_wall([str(python), "-c", "pass"], work))
        inside: dict[str, list[float]] = {"entry": [], "entry_net": [], "launcher": []}
        if swift_spec is not None:
            swift_dir = Path(list(swift_spec.submodule_search_locations)[0])
            # -S: site is not run, so the .pth runs exactly once, inside the timer; the path entry
            # to the packages is added by hand
            sys_path = f"import sys; sys.path[:0] = [{str(site)!r}, {sysconfig.get_paths()['purelib']!r}]\n"
            global _INSIDE
            _INSIDE = sys_path + _INSIDE
            for _ in range(args.runs):
                entry = str(swift_dir / "cli" / "sft.py")
                inside["entry"].append(_inside(pythons["wheel"], pth, entry, True, work))
                inside["entry_net"].append(_inside(pythons["wheel"], pth, entry, True, work, PRELOADED))
                inside["launcher"].append(_inside(pythons["wheel"], pth, str(pythons["wheel"].with_name("swift")), False,
                                                  work))
        medians = {name: statistics.median(values) for name, values in times["python -c pass"].items()}
        report = {
            "runs": args.runs,
            "python -c pass": {"bare_ms": medians["bare"] * 1e3, "wheel_ms": medians["wheel"] * 1e3,
                               "added_ms": (medians["wheel"] - medians["bare"]) * 1e3},
            "hook in the swift sft entry process (import + rewrite)": (
                {"median_ms": statistics.median(inside["entry"]) * 1e3} if inside["entry"] else "ms-swift not installed"),
            "hook in the swift sft entry process, net of stdlib modules ms-swift imports anyway": (
                {"median_ms": statistics.median(inside["entry_net"]) * 1e3} if inside["entry"] else "ms-swift not installed"),
            "hook in the swift launcher process (import, returns)": (
                {"median_ms": statistics.median(inside["launcher"]) * 1e3} if inside["launcher"] else "ms-swift not installed"),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        pass_ = report["python -c pass"]
        print(f"python -c pass, median of {args.runs} (alternating): without the plugin {pass_['bare_ms']:.2f} ms, "
              f"with it {pass_['wheel_ms']:.2f} ms, added {pass_['added_ms']:+.2f} ms")
        for key in ("hook in the swift sft entry process (import + rewrite)",
                    "hook in the swift sft entry process, net of stdlib modules ms-swift imports anyway",
                    "hook in the swift launcher process (import, returns)"):
            value = report[key]
            print(f"{key}: " + (f"median {value['median_ms']:.2f} ms" if isinstance(value, dict) else value))
    return 0


if __name__ == "__main__":
    sys.exit(main())

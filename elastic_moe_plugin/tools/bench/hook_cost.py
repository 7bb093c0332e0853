"""``elastic-moe bench --only hook-cost``: what the ms-swift start-up hook (``elastic-moe-swift.pth``)
costs, measured, not asserted (``docs/swift.md``, "Cost").

Builds the wheel of this source checkout and two fresh venvs that differ only in it: ``bare`` (no
plugin) and ``wheel`` (the wheel installed non-editable). Both see this interpreter's packages
(torch, ms-swift, ...) through the same ``.pth`` path entry. Then, alternating bare and wheel runs
so that load on the machine hits both alike (``--rounds`` of each; default 20, ``--quick`` 3):

- ``python -c pass``, wall time: any Python process that is not ms-swift (the ``.pth`` line compares
  strings and imports nothing);
- the hook's work inside ms-swift's entry process (``swift/cli/sft.py --plugin elastic_moe ...``):
  the ``.pth`` line executed in a fresh interpreter (``-S``, so that it runs once, inside the timer)
  whose ``sys.argv`` is that process's, timed from inside (the hook's import and the argv rewrite);
  again with the standard-library modules ms-swift imports anyway preloaded (:data:`PRELOADED`),
  which is what the hook adds to that process; and the same for the ``swift`` launcher process
  (the ``.pth`` line sees a script outside ``swift/cli/`` and imports nothing). Without ms-swift
  those rows are left out.

The last is what ``swift sft`` pays on top of its own start-up (seconds of imports); a full run is
too noisy to show a difference of that size. Needs a source checkout (``pyproject.toml``) and pip.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import venv
from pathlib import Path

from elastic_moe_plugin.tools.bench.schema import BenchRow, row

REPO = Path(__file__).resolve().parents[3]
DEFAULT_RUNS, QUICK_RUNS = 20, 3
#: standard-library modules ms-swift's entry process imports anyway (torch and swift import them
#: within its first milliseconds): preloaded, the hook's time is what it adds to that process
PRELOADED = ("typing", "logging", "pathlib", "dataclasses", "re", "importlib.util", "json", "inspect")

_INSIDE = """
import sys, time
sys.path[:0] = [{site!r}, {packages!r}]
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


def _clean_env() -> dict[str, str]:
    drop = ("PYTHONPATH", "VIRTUAL_ENV")
    return {k: v for k, v in os.environ.items() if k not in drop and not k.startswith(("ELASTIC_MOE_", "EMOE_"))}


def _purelib(python: Path) -> Path:
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    return Path(subprocess.run([str(python), "-c", code], check=True, capture_output=True, text=True).stdout.strip())


def _make_venv(root: Path, wheel: Path | None) -> Path:
    venv.EnvBuilder(with_pip=False).create(root)
    python = root / "bin" / "python"
    (_purelib(python) / "_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    if wheel is not None:
        install = [str(python), "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed", "-q"]
        subprocess.run([*install, str(wheel)], check=True, capture_output=True, text=True)
    return python


def _build_wheel(work: Path) -> Path:
    """The wheel of the checkout; the build's leftovers in the checkout removed (those it made)."""
    if not (REPO / "pyproject.toml").is_file():
        raise RuntimeError(f"--only hook-cost builds the wheel of a source checkout; {REPO} holds no pyproject.toml")
    leftovers = [path for path in (REPO / "build", REPO / "elastic_moe_plugin.egg-info") if not path.exists()]
    try:
        command = [sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "--no-build-isolation", "-q"]
        subprocess.run([*command, "-w", str(work / "dist")], check=True, capture_output=True, text=True, cwd=work)
    finally:
        for path in leftovers:
            shutil.rmtree(path, ignore_errors=True)
    return next((work / "dist").glob("*.whl"))


def _wall(argv: list[str], cwd: Path) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True, cwd=cwd, env=_clean_env(), stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def _inside(python: Path, pth: Path, site: Path, argv0: str, expect_rewrite: bool, cwd: Path, preload=()) -> float:
    code = _INSIDE.format(
        site=str(site),
        packages=sysconfig.get_paths()["purelib"],
        preload=tuple(preload),
        argv0=argv0,
        pth=str(pth),
        expect_rewrite=expect_rewrite,
    )
    done = subprocess.run(
        [str(python), "-S", "-c", code], check=True, cwd=cwd, env=_clean_env(), capture_output=True, text=True
    )
    return float(done.stdout.strip())


def run(quick: bool, runs: int | None = None) -> dict[str, dict[str, list[float]]]:
    """Seconds per run: ``{case: {variant: [...]}}`` (the module docstring's cases)."""
    runs = runs or (QUICK_RUNS if quick else DEFAULT_RUNS)
    work = Path(tempfile.mkdtemp(prefix="elastic_moe_hook_cost_"))
    try:
        wheel = _build_wheel(work)
        pythons = {"bare": _make_venv(work / "bare", None), "wheel": _make_venv(work / "wheel", wheel)}
        site = _purelib(pythons["wheel"])
        pth = site / "elastic-moe-swift.pth"
        if not pth.is_file():
            raise RuntimeError(f"the wheel installed no {pth.name} in {site}")
        times: dict[str, dict[str, list[float]]] = {"python -c pass": {"bare": [], "wheel": []}}
        for _ in range(3):  # warm the page cache
            for python in pythons.values():
                _wall([str(python), "-c", "pass"], work)
        for _ in range(runs):
            for name, python in pythons.items():
                times["python -c pass"][name].append(_wall([str(python), "-c", "pass"], work))
        swift = importlib.util.find_spec("swift")
        if swift is not None and swift.submodule_search_locations:
            entry = str(Path(next(iter(swift.submodule_search_locations))) / "cli" / "sft.py")
            launcher = str(pythons["wheel"].with_name("swift"))
            cases = {
                "swift sft entry process": (entry, True, ()),
                "swift sft entry process, net of stdlib": (entry, True, PRELOADED),
                "swift launcher process": (launcher, False, ()),
            }
            for case in cases:
                times[case] = {"wheel": []}
            for _ in range(runs):
                for case, (argv0, rewrite, preload) in cases.items():
                    seconds = _inside(pythons["wheel"], pth, site, argv0, rewrite, work, preload)
                    times[case]["wheel"].append(seconds)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return times


_SHAPES = {
    "python -c pass": "wall time of a Python process that is not ms-swift, without (bare) and with the wheel",
    "swift sft entry process": "the hook in swift sft's entry process: its import and the argv rewrite",
    "swift sft entry process, net of stdlib": "the same, standard-library modules ms-swift imports anyway preloaded",
    "swift launcher process": "the .pth line in the swift launcher process: a script outside swift/cli/, no import",
}


def rows(times: dict[str, dict[str, list[float]]]) -> list[BenchRow]:
    """The schema rows: one per (case, variant); ``wheel`` against ``bare`` where both ran."""
    out = []
    for case, variants in times.items():
        bare = statistics.median(variants["bare"]) * 1e3 if "bare" in variants else None
        for variant, seconds in variants.items():
            ms = [value * 1e3 for value in seconds]
            median = statistics.median(ms)
            compared = variant == "wheel" and bare is not None
            out.append(
                row(
                    "hook-cost",
                    case,
                    _SHAPES[case],
                    variant,
                    params={"runs": len(ms)},
                    metrics={"median_ms": median, "min_ms": min(ms), "max_ms": max(ms)},
                    baseline="bare" if compared else None,
                    ratios={"added_ms": median - bare, "time_ratio": median / bare} if compared and bare else None,
                )
            )
    return out


def format_table(times: dict[str, dict[str, list[float]]]) -> str:
    lines = [f"{'ms-swift start-up hook':42s} {'variant':7s} {'median ms':>10s} {'min-max ms':>17s} {'added ms':>9s}"]
    for item in rows(times):
        added = item["ratios"].get("added_ms")
        metrics = item["metrics"]
        lines.append(
            f"{item['scenario']:42s} {item['variant']:7s} {metrics['median_ms']:10.2f} "
            f"{metrics['min_ms']:8.2f}-{metrics['max_ms']:8.2f} {'' if added is None else f'{added:+9.2f}':>9s}"
        )
    lines.append(f"median of {item['params']['runs']} alternating runs each" if times else "")
    return "\n".join(lines)


__all__ = ["DEFAULT_RUNS", "PRELOADED", "QUICK_RUNS", "format_table", "rows", "run"]

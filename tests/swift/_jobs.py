"""Subprocess jobs run a few at a time, each once the jobs it depends on have finished.

For the end-to-end tests whose runs are whole ``megatron sft`` / ``swift sft`` / Megatron-LM
trainings: on a 2-core machine two single-rank runs (or one two-rank run) at a time keep both cores
busy without thrashing. A job's ``weight`` is its number of busy processes (its ranks); jobs start,
in the order given, while the running weights fit ``capacity`` (one job always may run). A job
whose dependency failed is not started (its result says so).
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import subprocess
import time
from collections.abc import Callable
from pathlib import Path


@dataclasses.dataclass
class Job:
    name: str
    argv: list[str] | Callable[[], list[str]]  # a callable is evaluated when the job starts
    env: dict[str, str]
    cwd: Path
    weight: int = 1
    after: tuple[str, ...] = ()
    timeout: float = 400.0


@dataclasses.dataclass
class JobResult:
    name: str
    argv: list[str]
    returncode: int
    output: str  # stdout and stderr, interleaved
    seconds: float
    cwd: Path

    @property
    def command(self) -> str:
        return shlex.join(self.argv)

    def describe(self, tail: int = 6000) -> str:
        return f"{self.name}: rc={self.returncode} after {self.seconds:.0f}s\n$ {self.command}\n{self.output[-tail:]}"


def run_jobs(jobs: list[Job], logs: Path, capacity: int = 2) -> dict[str, JobResult]:
    """Run ``jobs`` (see the module docstring); every result, by name."""
    pending = list(jobs)
    running: dict[str, tuple[subprocess.Popen, Job, list[str], float, Path]] = {}
    results: dict[str, JobResult] = {}
    logs.mkdir(parents=True, exist_ok=True)
    while pending or running:
        for name, (process, job, argv, started, log) in list(running.items()):
            elapsed = time.monotonic() - started
            if process.poll() is None and elapsed < job.timeout:
                continue
            if process.poll() is None:
                process.kill()
                process.wait()
            results[name] = JobResult(name, argv, process.returncode if elapsed < job.timeout else -9,
                                      log.read_text(errors="replace"), elapsed, job.cwd)
            del running[name]
        for job in list(pending):
            failed = [dep for dep in job.after if dep in results and results[dep].returncode != 0]
            if failed:
                pending.remove(job)
                results[job.name] = JobResult(job.name, [], -1, f"not started: {', '.join(failed)} failed", 0.0, job.cwd)
                continue
            if any(dep not in results for dep in job.after):
                continue
            busy = sum(entry[1].weight for entry in running.values())
            if running and busy + job.weight > capacity:
                break  # keep the order: the next job waits for room
            pending.remove(job)
            argv = job.argv() if callable(job.argv) else list(job.argv)
            log = logs / f"{job.name}.log"
            job.cwd.mkdir(parents=True, exist_ok=True)
            with log.open("wb") as sink:  # a file, not a pipe: nobody reads a pipe while jobs overlap
                process = subprocess.Popen(argv, cwd=job.cwd, env=job.env, stdout=sink, stderr=subprocess.STDOUT)
            running[job.name] = (process, job, argv, time.monotonic(), log)
        time.sleep(0.2)
    return results


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def environ_without(prefixes: tuple[str, ...], names: tuple[str, ...] = ()) -> dict[str, str]:
    """``os.environ`` minus the variables starting with ``prefixes`` or named in ``names``."""
    return {k: v for k, v in os.environ.items() if not k.startswith(prefixes) and k not in names}

"""The lab's inputs: user-supplied router logits read from a file, and the argument checks shared
by :func:`~elastic_moe_plugin.tools.gates_lab.comparison.compare` and
:func:`~elastic_moe_plugin.tools.gates_lab.gradcheck.gradcheck_router`.

Logits are ``[T, E]`` (T tokens, E >= 2 experts), real and finite; :func:`load_logits` returns
them as float64 and reads a single row ``[E]`` as one token. Error messages name the CLI flag
(``--logits``, ``--k``, ...), the value and what is accepted, so the CLI prints them as they are.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from elastic_moe_plugin.tools.gates_lab.conventions import CONVENTION_NAMES, get_convention

#: ``--dtype`` name -> the lab's compute dtype.
DTYPES = {"float64": torch.float64, "float32": torch.float32}

_LOGIT_SUFFIXES = (".pt", ".pth", ".npy", ".json")


def check_int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}={value!r} is invalid: expected an integer >= {low}.")
    return value


def convention_names(conventions: Sequence[str] | str | None) -> tuple[str, ...]:
    """The conventions to run: all by default, else the given names (or a comma-separated string)."""
    if conventions is None:
        return CONVENTION_NAMES
    if isinstance(conventions, str):
        conventions = [c for c in conventions.replace(" ", "").split(",") if c]
    names = tuple(conventions)
    if not names:
        raise ValueError(f"--conventions is empty: expected a comma-separated subset of {', '.join(CONVENTION_NAMES)}.")
    for name in names:
        get_convention(name)  # raises naming the accepted values
    return names


def load_logits(path: str | Path) -> torch.Tensor:
    """Read user-supplied router logits ``[T, E]`` (a single row ``[E]`` is one token).

    Accepted files: ``.pt`` / ``.pth`` (a tensor, or a dict with a ``"logits"`` tensor; loaded
    with ``weights_only=True``), ``.npy`` (no pickles) and ``.json`` (a list of rows, or
    ``{"logits": [...]}``).

    Raises:
        ValueError: for a missing file, another extension, a non-numeric or non-finite array,
            or a shape other than ``[E]`` / ``[T, E]``.
    """
    data = _read_logits_file(path)
    try:
        logits = torch.as_tensor(data)
    except (TypeError, ValueError, RuntimeError) as error:
        raise ValueError(f"--logits {str(path)!r}: not a numeric array ({error}).") from None
    if logits.dim() == 1:
        logits = logits[None, :]
    if logits.dim() != 2 or logits.shape[0] < 1 or logits.shape[1] < 2:
        raise ValueError(
            f"--logits {str(path)!r}: expected shape [tokens, experts] with at least 2 experts, "
            f"got {tuple(logits.shape)}."
        )
    if logits.is_complex() or logits.dtype == torch.bool:
        raise ValueError(f"--logits {str(path)!r}: expected real numbers, got dtype {logits.dtype}.")
    logits = logits.to(torch.float64)
    if not torch.isfinite(logits).all():
        raise ValueError(f"--logits {str(path)!r}: every logit must be finite (found NaN or inf).")
    return logits


def _read_logits_file(path: str | Path) -> Any:
    """The file's content as loaded (a tensor, array, list or the ``"logits"`` entry of a mapping)."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--logits {str(path)!r}: no such file.")
    suffix = file.suffix.lower()
    if suffix not in _LOGIT_SUFFIXES:
        raise ValueError(
            f"--logits {str(path)!r}: unsupported file type {suffix or '(none)'!r}; expected .pt/.pth, .npy or .json."
        )
    try:
        if suffix == ".npy":
            import numpy

            data = torch.from_numpy(numpy.load(file, allow_pickle=False))
        elif suffix == ".json":
            data = json.loads(file.read_text())
        else:
            data = torch.load(file, map_location="cpu", weights_only=True)
    # Each reader fails its own way (pickle, zip, JSON, numpy errors): all are bad input here.
    except Exception as error:
        raise ValueError(f"--logits {str(path)!r}: could not read it ({error}).") from None
    if isinstance(data, dict):
        if "logits" not in data:
            raise ValueError(f"--logits {str(path)!r}: a mapping must hold the key 'logits', got {sorted(data)}.")
        data = data["logits"]
    return data

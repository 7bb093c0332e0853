"""Probe sets: token ids read from files, cut into windows and batched for teacher forcing.

A probe file is one task: a list of 1-D LongTensors of token ids. :func:`chunk_sequences` cuts
them into windows of at most ``seq_len`` tokens and :func:`probe_batches` right-pads windows into
``ids`` [B, S] (pad 0) and ``valid`` [B, S] (True = a real token). Every model sees the same
windows, so token positions line up across models.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from elastic_moe_plugin.tools.diagnose.errors import DiagnosticsError

PROBE_SUFFIXES = (".pt", ".pth", ".npy", ".json", ".jsonl", ".txt")


@dataclasses.dataclass
class ProbeTask:
    """One probe file: ``sequences`` are 1-D LongTensors of token ids (any lengths ≥ 2)."""

    name: str
    path: str
    sequences: list[torch.Tensor]

    @property
    def num_tokens(self) -> int:
        return sum(int(s.numel()) for s in self.sequences)


def _is_id_list(row: Any) -> bool:
    return isinstance(row, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool) for x in row)


def _tensor_sequences(data: torch.Tensor, where: str) -> list[torch.Tensor]:
    if data.is_floating_point() or data.is_complex() or data.dtype == torch.bool:
        raise DiagnosticsError(f"probe file {where}: expected integer token ids, found dtype {data.dtype}.")
    if data.dim() == 1:
        return [data.long()]
    if data.dim() == 2:
        return [row.long() for row in data]
    raise DiagnosticsError(
        f"probe file {where}: expected a 1-D or 2-D array of token ids, got shape {tuple(data.shape)}."
    )


def _list_sequences(data: list | tuple, where: str) -> list[torch.Tensor]:
    if _is_id_list(data):
        return [torch.tensor(data, dtype=torch.long)]
    sequences = []
    for i, row in enumerate(data):
        if isinstance(row, dict):
            sequences += _as_sequences(row, f"{where}[{i}]")
        elif _is_id_list(row):
            sequences.append(torch.tensor(row, dtype=torch.long))
        else:
            raise DiagnosticsError(f"probe file {where}: item {i} is not a list of integer token ids.")
    return sequences


def _as_sequences(data: Any, where: str) -> list[torch.Tensor]:
    """Ints, a list of int lists, a 1-D/2-D int tensor/array, or a dict holding one of these."""
    if isinstance(data, dict):
        for key in ("input_ids", "tokens", "ids"):
            if key in data:
                return _as_sequences(data[key], where)
        raise DiagnosticsError(f"probe file {where}: a dict needs an 'input_ids' (or 'tokens') entry.")
    try:
        import numpy as np

        if isinstance(data, np.ndarray):
            data = torch.from_numpy(data)
    except ImportError:  # pragma: no cover - numpy ships with torch
        pass
    if isinstance(data, torch.Tensor):
        return _tensor_sequences(data, where)
    if isinstance(data, (list, tuple)):
        return _list_sequences(data, where)
    raise DiagnosticsError(f"probe file {where}: cannot read token ids from a {type(data).__name__}.")


def _read_text(file: Path, suffix: str, tokenizer: Any) -> list[torch.Tensor]:
    """One instance per non-empty line (``.jsonl``: its ``"text"`` field), no special tokens."""
    lines = file.read_text(encoding="utf-8").splitlines()
    texts = [json.loads(line)["text"] if suffix == ".jsonl" else line for line in lines if line.strip()]
    return [torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long) for text in texts]


def _read_torch(file: Path, where: str) -> list[torch.Tensor]:
    try:
        data = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as error:
        raise DiagnosticsError(f"probe file {where}: cannot be read by torch.load ({error}).") from None
    return _as_sequences(data, where)


def _read_numpy(file: Path, where: str) -> list[torch.Tensor]:
    import numpy as np

    try:
        data = np.load(file, allow_pickle=False)
    except ValueError as error:
        raise DiagnosticsError(f"probe file {where}: {error}") from None
    return _as_sequences(data, where)


def _read_jsonl(file: Path, where: str) -> list[torch.Tensor]:
    rows = [json.loads(line) for line in file.read_text(encoding="utf-8").splitlines() if line.strip()]
    return _as_sequences(rows, where)


def _read_integer_lines(file: Path, where: str) -> list[torch.Tensor]:
    sequences = []
    for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            sequences.append(torch.tensor([int(x) for x in line.split()], dtype=torch.long))
        except ValueError:
            raise DiagnosticsError(
                f"probe file {where}, line {number}: not whitespace-separated integer token ids; for a text "
                f"file pass --tokenizer NAME_OR_PATH."
            ) from None
    return sequences


def load_probe(path: str | os.PathLike[str], *, tokenizer: Any = None, name: str | None = None) -> ProbeTask:
    """Read one probe file.

    Formats: ``.pt``/``.pth`` (a tensor, a list of lists, or a dict with ``input_ids``), ``.npy``,
    ``.json`` (the same as lists), ``.jsonl`` (one list or ``{"input_ids": [...]}`` per line),
    ``.txt`` of whitespace-separated integers (one sequence per line). With ``tokenizer`` (a
    transformers tokenizer) a ``.txt``/``.jsonl`` file is text instead: one instance per non-empty
    line (``.jsonl``: its ``"text"`` field), tokenised without special tokens added.

    Raises:
        DiagnosticsError: missing file, unknown suffix, non-integer content, fewer than 2 tokens.
    """
    file = Path(path)
    if not file.is_file():
        raise DiagnosticsError(f"probe file {str(path)!r} does not exist.")
    suffix = file.suffix.lower()
    if suffix not in PROBE_SUFFIXES:
        raise DiagnosticsError(
            f"probe file {str(path)!r}: unknown format {suffix!r}; expected one of {', '.join(PROBE_SUFFIXES)}."
        )
    where = str(path)
    if tokenizer is not None and suffix in (".txt", ".jsonl"):
        sequences = _read_text(file, suffix, tokenizer)
    elif suffix in (".pt", ".pth"):
        sequences = _read_torch(file, where)
    elif suffix == ".npy":
        sequences = _read_numpy(file, where)
    elif suffix == ".json":
        sequences = _as_sequences(json.loads(file.read_text(encoding="utf-8")), where)
    elif suffix == ".jsonl":
        sequences = _read_jsonl(file, where)
    else:
        sequences = _read_integer_lines(file, where)
    sequences = [s for s in sequences if s.numel() >= 2]
    if not sequences:
        raise DiagnosticsError(f"probe file {where} holds no sequence of at least 2 tokens.")
    return ProbeTask(name=name or file.stem, path=where, sequences=sequences)


def chunk_sequences(sequences: Sequence[torch.Tensor], seq_len: int) -> list[torch.Tensor]:
    """Split every sequence into consecutive windows of at most ``seq_len`` tokens (≥ 2 kept)."""
    windows = []
    for sequence in sequences:
        for start in range(0, sequence.numel(), seq_len):
            window = sequence[start : start + seq_len]
            if window.numel() >= 2:
                windows.append(window)
    return windows


def probe_batches(sequences: Sequence[torch.Tensor], batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Right-padded batches: ids [B, S] (pad 0) and valid [B, S] (True = a real token).

    Right padding leaves every real token's causal context unchanged, and padded positions are
    dropped from every statistic.
    """
    for start in range(0, len(sequences), batch_size):
        group = sequences[start : start + batch_size]
        length = max(int(s.numel()) for s in group)
        ids = torch.zeros(len(group), length, dtype=torch.long)
        valid = torch.zeros(len(group), length, dtype=torch.bool)
        for row, sequence in enumerate(group):
            ids[row, : sequence.numel()] = sequence
            valid[row, : sequence.numel()] = True
        yield ids, valid

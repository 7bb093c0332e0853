"""The demo's training data: a synthetic six-task mixture (no download) or a file as bytes.

Synthetic (vocabulary 148): one task per sequence, its tag token first, each task on its own
sub-vocabulary so experts have something to specialise on:

- 0 separator, 1..6 task tags (7 unused);
- 8..39 copy / reverse: words of 3-10 "letters", each followed by itself copied or reversed;
- 40..51 addition: ``a + b = a+b`` in decimal digits (``+`` 50, ``=`` 51);
- 52..83 markov-a: a chain with 4 random successors per state, Dirichlet(1) transition weights;
- 84..115 markov-b: a chain with 2 random successors per state, Dirichlet(4) transition weights;
- 116..147 counting: x, x+s, x+2s, ... mod 32.

A file (``--data``) is byte-level tokens (vocabulary 256, no tokenizer): the first 90% trains as
windows at random offsets, the last 10% is held out as non-overlapping windows.

Batches and held-out splits are sequences [N, seq_len + 1] (inputs ``[:, :-1]``, labels
``[:, 1:]``); the splits come from :data:`~elastic_moe_plugin.tools.demo.settings.CORPUS_SEED`, never from
``--seed``, which only orders the batches.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from elastic_moe_plugin.core.errors import ConfigError
from elastic_moe_plugin.tools.demo.settings import CORPUS_SEED, DemoSettings

SEP = 0
TASKS = ("copy", "reverse", "addition", "markov-a", "markov-b", "counting")
_TAG = {name: 1 + i for i, name in enumerate(TASKS)}  # tags 1..6; 7 unused
_LETTERS = range(8, 40)  # copy / reverse share 32 "letters"
_DIGITS = 40  # 0-9 -> 40..49, '+' 50, '=' 51
_PLUS, _EQUALS = 50, 51
_MARKOV_A = range(52, 84)
_MARKOV_B = range(84, 116)
_COUNT = range(116, 148)
SYNTHETIC_VOCAB = 148


def _markov_table(states: range, rng: random.Random, successors: int, concentration: float):
    """Each state -> ``successors`` random next states with random (cumulative) weights."""
    table = {}
    for state in states:
        nexts = rng.sample(list(states), successors)
        weights = [rng.gammavariate(concentration, 1.0) for _ in nexts]
        total = sum(weights)
        table[state] = (nexts, [w / total for w in weights])
    return table


class SyntheticLanguages:
    """A generator of the six-task mixture; one task per sequence, the tag token first."""

    def __init__(self, seed: int = CORPUS_SEED) -> None:
        tables = random.Random(seed)
        self.markov_a = _markov_table(_MARKOV_A, tables, successors=4, concentration=1.0)
        self.markov_b = _markov_table(_MARKOV_B, tables, successors=2, concentration=4.0)

    def _digits(self, value: int) -> list[int]:
        return [_DIGITS + int(d) for d in str(value)]

    def sequence(self, rng: random.Random, length: int) -> list[int]:
        task = TASKS[rng.randrange(len(TASKS))]
        tokens = [_TAG[task]]
        while len(tokens) < length:
            if task in ("copy", "reverse"):
                word = [rng.choice(_LETTERS) for _ in range(rng.randint(3, 10))]
                tokens += word + [SEP] + (word if task == "copy" else word[::-1]) + [SEP]
            elif task == "addition":
                a, b = rng.randrange(1000), rng.randrange(1000)
                tokens += self._digits(a) + [_PLUS] + self._digits(b) + [_EQUALS] + self._digits(a + b) + [SEP]
            elif task in ("markov-a", "markov-b"):
                table = self.markov_a if task == "markov-a" else self.markov_b
                state = rng.choice(list(table))
                for _ in range(length):
                    tokens.append(state)
                    nexts, weights = table[state]
                    state = rng.choices(nexts, weights)[0]
            else:  # counting: x, x+s, x+2s, ... mod 32
                start, step = rng.randrange(32), rng.randint(1, 7)
                tokens += [_COUNT[(start + i * step) % 32] for i in range(rng.randint(6, 12))] + [SEP]
        return tokens[:length]

    def sequences(self, seed: int, count: int, length: int) -> torch.Tensor:
        rng = random.Random(seed)
        return torch.tensor([self.sequence(rng, length) for _ in range(count)], dtype=torch.long)


@dataclasses.dataclass
class Corpus:
    """Fixed train and held-out splits of sequences of ``seq_len + 1`` tokens."""

    description: str
    vocab_size: int
    seq_len: int
    heldout: torch.Tensor  # [M, seq_len + 1]
    train: torch.Tensor | None = None  # [N, seq_len + 1] (synthetic)
    stream: torch.Tensor | None = None  # [L] byte stream (file); windows drawn at random

    def batches(self, steps: int, batch_size: int, seed: int) -> Iterator[torch.Tensor]:
        """``steps`` batches [batch_size, seq_len + 1]; the order depends only on ``seed``."""
        generator = torch.Generator().manual_seed(seed)
        if self.train is not None:
            order = torch.empty(0, dtype=torch.long)
            for _ in range(steps):
                if order.numel() < batch_size:
                    order = torch.cat([order, torch.randperm(self.train.shape[0], generator=generator)])
                yield self.train[order[:batch_size]]
                order = order[batch_size:]
        else:
            stream, span = self._stream(), self.seq_len + 1
            for _ in range(steps):
                starts = torch.randint(0, stream.numel() - span + 1, (batch_size,), generator=generator)
                yield torch.stack([stream[s : s + span] for s in starts.tolist()])

    def _stream(self) -> torch.Tensor:
        """The byte stream of a corpus without a train split (a file's)."""
        assert self.stream is not None, "a corpus holds a train split or a byte stream"
        return self.stream

    def to_dict(self) -> dict[str, Any]:
        info = {
            "description": self.description,
            "vocab_size": self.vocab_size,
            "seq_len": self.seq_len,
            "heldout_sequences": int(self.heldout.shape[0]),
        }
        if self.train is not None:
            info["train_sequences"] = int(self.train.shape[0])
        else:
            info["train_bytes"] = int(self._stream().numel())
        return info


def synthetic_corpus(settings: DemoSettings) -> Corpus:
    """The six-task mixture. The train split holds what the budget reads (at most 32768
    sequences, then epochs); a shorter run's split is a prefix of a longer one's."""
    languages = SyntheticLanguages(CORPUS_SEED)
    span = settings.seq_len + 1
    train_count = min(settings.steps * settings.batch_size, 32768)
    return Corpus(
        description=f"synthetic mixture of {len(TASKS)} tasks ({', '.join(TASKS)}), one per sequence, "
        f"tag token first; corpus seed {CORPUS_SEED}",
        vocab_size=SYNTHETIC_VOCAB,
        seq_len=settings.seq_len,
        heldout=languages.sequences(CORPUS_SEED + 1, settings.heldout_sequences, span),
        train=languages.sequences(CORPUS_SEED + 2, train_count, span),
    )


def file_corpus(path: str, settings: DemoSettings) -> Corpus:
    """A user's file as byte-level tokens (vocabulary 256). The last 10% of the bytes is held out
    as non-overlapping windows; training windows start at random offsets in the first 90%."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"--data {path!r}: no such file.")
    data = torch.frombuffer(bytearray(file.read_bytes()), dtype=torch.uint8).long()
    span = settings.seq_len + 1
    split = int(data.numel() * 0.9)
    if split < 4 * span or data.numel() - split < span:
        raise ConfigError(
            f"--data {path!r} has {data.numel()} bytes: expected at least {10 * span} "
            f"(the held-out last 10% must hold one window of {span} bytes)."
        )
    heldout = data[split:]
    count = min(settings.heldout_sequences, heldout.numel() // span)
    return Corpus(
        description=f"{file.name}: {data.numel()} bytes as byte-level tokens (vocab 256); first 90% train "
        f"(random windows), last 10% held out ({count} windows)",
        vocab_size=256,
        seq_len=settings.seq_len,
        heldout=heldout[: count * span].view(count, span).clone(),
        stream=data[:split].clone(),
    )

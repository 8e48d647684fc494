"""The shipped corpus (docstrings of the CPython standard library, PSF License) as a char dataset."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

CORPUS_PATH = Path(__file__).parent / "data" / "corpus.txt"


def load_corpus() -> str:
    return CORPUS_PATH.read_text(encoding="ascii")


@dataclass(frozen=True)
class CharVocab:
    chars: str

    @staticmethod
    def from_text(text: str) -> "CharVocab":
        return CharVocab("".join(sorted(set(text))))

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        table = {c: i for i, c in enumerate(self.chars)}
        return [table[c] for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)


class CharDataset:
    """Sample i is the window starting at i * context_len; y is x shifted by one character."""

    def __init__(self, text: str, vocab: CharVocab, context_len: int) -> None:
        data = torch.tensor(vocab.encode(text), dtype=torch.long)
        n = (len(data) - 1) // context_len
        self.context_len = context_len
        self._windows = torch.stack([data[i * context_len : i * context_len + context_len + 1] for i in range(n)])

    def __len__(self) -> int:
        return self._windows.shape[0]

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        w = self._windows[torch.from_numpy(np.array(indices, dtype=np.int64))]
        return w[:, :-1], w[:, 1:]

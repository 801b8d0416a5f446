"""Text preprocessing, the one implementation used to build token ids and in Triton's raw-text step.

Standalone (standard library and numpy only): the exporter copies it beside the Python backend
model that turns UTF-8 text into token ids for the ensemble. Lower-cased words (\\w+), looked up in
the vocabulary; id 0 is padding, id 1 an unknown word; at most `max_length` tokens.
"""

from __future__ import annotations

import re

import numpy as np

PAD, UNKNOWN = 0, 1
_WORD = re.compile(r"\w+", re.UNICODE)


def tokenize(text: str, vocab: dict[str, int], max_length: int) -> np.ndarray:
    """UTF-8 text -> int64 token ids (at least one: an empty text is one unknown token)."""
    ids = [vocab.get(w, UNKNOWN) for w in _WORD.findall(text.lower())[:max_length]]
    return np.asarray(ids or [UNKNOWN], dtype=np.int64)


def vocabulary(words: list[str]) -> dict[str, int]:
    """Word -> id, ids from 2 in the file's order (0 and 1 are padding and unknown)."""
    return {w: i + 2 for i, w in enumerate(words)}

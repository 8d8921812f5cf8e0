"""Token ids as numpy arrays: one view type for SGLang's ``array('q')``, lists and tuples, and
prefix comparison as one vector compare (host work at a 32k-token transcript must not be one
Python step per token)."""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np


def as_token_array(tokens: Sequence[int]) -> np.ndarray:
    """[n] int64 view of token ids (no copy for SGLang's ``array('q')`` or an int64 array)."""
    if isinstance(tokens, np.ndarray) and tokens.dtype == np.int64:
        return tokens
    if isinstance(tokens, array) and tokens.typecode == "q":
        return np.frombuffer(tokens, dtype=np.int64) if len(tokens) else np.zeros(0, np.int64)
    return np.asarray(tokens, dtype=np.int64).reshape(-1)


def common_prefix(a: np.ndarray, b: np.ndarray, pos: int = 0) -> int:
    """Length of the common prefix of ``a`` and ``b[pos:]`` (one vector compare)."""
    n = min(a.shape[0], b.shape[0] - pos)
    if n <= 0:
        return 0
    diff = a[:n] != b[pos : pos + n]
    i = int(diff.argmax())
    return i if diff[i] else n

"""Split a request's token ids into agent head + shared context + suffix.

::

    token index   0 ............ h ...................... s ............. n
                  | agent head   | shared context         | suffix        |
                  | exact, per   | matched across agents  | always        |
                  | agent        | by its tokens alone    | recomputed    |

Two ways to get the split, no engine imports here (pure bookkeeping):

- **Template detection (zero config).** The served chat template's markers
  (``tree/template_markers.py``) find a prompt's system turn: a prompt that starts with
  ``system_open`` has as head everything up to the end of the first
  :attr:`~sglang_kvcmas.tree.template_markers.TemplateMarkers.head_close` after it; the shared
  context runs up to the last generation opener (the opener and anything after it is the
  suffix), else to the prompt's end. ChatML: ``<|im_start|>system\\n ... <|im_end|>\\n`` is the
  head and ``<|im_start|>assistant\\n`` starts the suffix. The agent is the head itself (its
  token ids), so two requests with the same system prompt are the same agent.
- **Explicit (``/generate``, and ``/v1/chat/completions`` through ``custom_params``, which the
  chat route also sets from the request's messages: ``integration/chat_split_hook.py``).**
  ``sampling_params.custom_params = {"kvcmas_agent": NAME, "kvcmas_head_len": H}`` (optionally
  ``"kvcmas_shared_end": S``), parsed by ``policy/request_options.py``. Explicit values win.

A request without a head is not an agent request: it is served by plain prefix caching only.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from sglang_kvcmas.policy.request_options import RequestOptions
from sglang_kvcmas.tokens import as_token_array
from sglang_kvcmas.tree.template_markers import TemplateMarkers


@dataclass(frozen=True)
class AgentSplit:
    """Where one request's agent head and shared context lie.

    Attributes:
        agent: stable agent id (explicit name, or ``"head:<sha1 of head ids>"``).
        head_len: tokens ``[0, head_len)`` are the agent head.
        shared_end: tokens ``[head_len, shared_end)`` are the shared context.
    """

    agent: str
    head_len: int
    shared_end: int

    def __post_init__(self) -> None:
        if not 0 < self.head_len <= self.shared_end:
            raise ValueError(f"bad split head_len={self.head_len} shared_end={self.shared_end}")

    @property
    def shared_len(self) -> int:
        return self.shared_end - self.head_len


def head_agent_id(head: Sequence[int]) -> str:
    """The agent id of a head: a digest of its token ids."""
    digest = hashlib.sha1(",".join(map(str, head)).encode()).hexdigest()[:16]
    return f"head:{digest}"


HEAD_SEARCH_LIMIT = 1 << 16
"""The head's separator is looked for in the first this many tokens only."""


def find_first(arr: np.ndarray, pattern: Sequence[int], start: int = 0) -> int:
    """Index of the first occurrence of ``pattern`` in ``arr[start:]`` (as an index of ``arr``),
    or -1. One vector compare per pattern token (patterns are a few ids)."""
    hits = _occurrences(arr, pattern, start)
    return int(hits[0]) if hits.size else -1


def find_last(arr: np.ndarray, pattern: Sequence[int], start: int = 0) -> int:
    """Index of the last occurrence of ``pattern`` in ``arr[start:]``, or -1."""
    hits = _occurrences(arr, pattern, start)
    return int(hits[-1]) if hits.size else -1


def _occurrences(arr: np.ndarray, pattern: Sequence[int], start: int) -> np.ndarray:
    m, n = len(pattern), arr.shape[0]
    if m == 0 or n - start < m:
        return np.zeros(0, np.int64)
    mask = arr[start : n - m + 1] == pattern[0]
    for i in range(1, m):
        mask &= arr[start + i : n - m + 1 + i] == pattern[i]
    return np.flatnonzero(mask) + start


def find_first_reference(ids: Sequence[int], pattern: Sequence[int], start: int = 0) -> int:
    """Reference for :func:`find_first`: one Python step per position."""
    m = len(pattern)
    for i in range(start, len(ids) - m + 1):
        if m and list(ids[i : i + m]) == list(pattern):
            return i
    return -1


def _opener_end(arr: np.ndarray, opener: tuple[int, ...]) -> int:
    """Where the system text starts: after ``opener`` at 0, or at 1 when a tokenizer added its
    BOS again before a rendered prompt that already starts with it; -1 when neither."""
    m = len(opener)
    for at in (0, 1):
        if at and not (arr.shape[0] > m and arr[0] == opener[0]):
            break
        if tuple(int(t) for t in arr[at : at + m]) == opener:
            return at + m
    return -1


def detect_template_split(ids: Sequence[int], markers: TemplateMarkers) -> AgentSplit | None:
    """The template split of ``ids`` (see the module docstring), or None when the prompt has no
    system turn or no shared part."""
    n, opener = len(ids), markers.system_open
    if n <= len(opener) + len(markers.head_sep):
        return None
    arr = as_token_array(ids)
    start = _opener_end(arr, opener)
    if start < 0:
        return None
    sep_at = find_first(arr[:HEAD_SEARCH_LIMIT], markers.head_close, start)
    if sep_at < 0:
        return None
    head_len = sep_at + markers.head_keep
    shared_end = shared_end_after(arr, head_len, markers.generation_open)
    if shared_end is None:
        return None
    return AgentSplit(head_agent_id(ids[:head_len]), head_len, shared_end)


def shared_end_after(ids: Sequence[int], head_len: int,
                     generation_open: Sequence[int]) -> int | None:
    """Where the shared transcript after a head of ``head_len`` ends: at the last generation
    opener past the head (the suffix is the opener and anything after it), else the prompt's
    end; None when nothing would be shared."""
    n, m = len(ids), len(generation_open)
    arr = as_token_array(ids)
    if m and n - m > head_len and tuple(int(t) for t in arr[n - m :]) == tuple(generation_open):
        return n - m  # the common case: the prompt ends with the generation prompt
    last_gen = find_last(arr, generation_open, head_len) if m else -1
    shared_end = last_gen if last_gen > head_len else n
    return shared_end if shared_end > head_len else None


def explicit_split(ids: Sequence[int], options: RequestOptions) -> AgentSplit | None:
    """The split a request's options name, or None if they name none.

    An explicit agent name is keyed with its head's tokens: one name sent with two different
    heads is two agents, never one mixed set of leaves.

    Raises:
        RequestOptionError: if the fields do not fit the prompt.
    """
    if options.head_len is None:
        return None
    options.check_prompt(len(ids))
    head = head_agent_id(ids[: options.head_len])
    agent = f"name:{options.agent}/{head}" if options.agent else head
    shared_end = options.shared_end if options.shared_end is not None else len(ids)
    return AgentSplit(agent, options.head_len, shared_end)


def split_request(
    ids: Sequence[int], options: RequestOptions, markers: TemplateMarkers | None
) -> AgentSplit | None:
    """Explicit split if given, else template detection, else None (not an agent request).

    Raises:
        RequestOptionError: if explicit fields do not fit the prompt.
    """
    split = explicit_split(ids, options)
    if split is not None:
        return split
    return detect_template_split(ids, markers) if markers is not None else None

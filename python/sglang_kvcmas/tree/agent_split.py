"""Split a request's token ids into agent head + shared context + suffix.

::

    token index   0 ............ h ...................... s ............. n
                  | agent head   | shared context         | suffix        |
                  | exact, per   | matched across agents  | always        |
                  | agent        | by its tokens alone    | recomputed    |

Two ways to get the split, no engine imports here (pure bookkeeping):

- **ChatML detection (zero config).** A prompt that starts with a system turn
  (``<|im_start|>system\\n ... <|im_end|>\\n``) has that whole turn as its head; the shared context
  runs up to the last ``<|im_start|>`` (the assistant opener ``<|im_start|>assistant\\n`` and
  anything after it is the suffix). The agent is the head itself (its token ids), so two requests
  with the same system prompt are the same agent.
- **Explicit (``/generate``).** ``sampling_params.custom_params = {"kvcmas_agent": NAME,
  "kvcmas_head_len": H}`` (optionally ``"kvcmas_shared_end": S``), parsed by
  ``policy/request_options.py``. Explicit values win.

A request without a head is not an agent request: it is served by plain prefix caching only.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from sglang_kvcmas.policy.request_options import RequestOptions
from sglang_kvcmas.tokens import as_token_array



@dataclass(frozen=True)
class ChatTemplateIds:
    """Token ids that delimit ChatML turns.

    Attributes:
        im_start: id of ``<|im_start|>``.
        im_end: id of ``<|im_end|>``.
        system: id of the ``system`` role token that follows ``<|im_start|>``.
    """

    im_start: int
    im_end: int
    system: int


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


def detect_chatml_split(ids: Sequence[int], chat: ChatTemplateIds) -> AgentSplit | None:
    """The ChatML split of ``ids``, or None when the prompt has no system turn or no shared part."""
    n = len(ids)
    if n < 4 or ids[0] != chat.im_start or ids[1] != chat.system:
        return None
    arr = as_token_array(ids)
    ends = np.flatnonzero(arr[: min(n, 1 << 16)] == chat.im_end)
    if not ends.size:
        return None
    head_len = int(ends[0]) + 1
    # Include the newline after <|im_end|>; it is the same token that follows the role name.
    if head_len < n and ids[head_len] == ids[2]:
        head_len += 1
    starts = np.flatnonzero(arr == chat.im_start)
    last_start = int(starts[-1]) if starts.size else -1
    shared_end = last_start if last_start > head_len else n
    if shared_end <= head_len:
        return None
    return AgentSplit(head_agent_id(ids[:head_len]), head_len, shared_end)


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
    ids: Sequence[int], options: RequestOptions, chat: ChatTemplateIds | None
) -> AgentSplit | None:
    """Explicit split if given, else ChatML detection, else None (not an agent request).

    Raises:
        RequestOptionError: if explicit fields do not fit the prompt.
    """
    split = explicit_split(ids, options)
    if split is not None:
        return split
    return detect_chatml_split(ids, chat) if chat is not None else None


def chat_ids_for(tokenizer_path: str | None) -> ChatTemplateIds | None:
    """ChatML delimiter ids of a tokenizer, or None when it has no ChatML tokens."""
    if not tokenizer_path:
        return None
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    ids = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    system = tok.encode("system", add_special_tokens=False)
    if any(i is None or i == tok.unk_token_id for i in ids) or len(system) != 1:
        return None
    return ChatTemplateIds(ids[0], ids[1], system[0])

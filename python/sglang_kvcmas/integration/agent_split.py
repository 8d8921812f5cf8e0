"""Split a request's token ids into agent head + shared context + suffix (DESIGN.md §4).

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
  "kvcmas_head_len": H}`` (optionally ``"kvcmas_shared_end": S``). Explicit values win.

A request without a head is not an agent request: it is served by plain prefix caching only.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

AGENT_FIELD = "kvcmas_agent"
HEAD_LEN_FIELD = "kvcmas_head_len"
SHARED_END_FIELD = "kvcmas_shared_end"


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
    try:
        end = list(ids[: min(n, 1 << 16)]).index(chat.im_end)
    except ValueError:
        return None
    head_len = end + 1
    # Include the newline after <|im_end|>; it is the same token that follows the role name.
    if head_len < n and ids[head_len] == ids[2]:
        head_len += 1
    last_start = n - 1 - list(reversed(ids)).index(chat.im_start) if chat.im_start in ids else -1
    shared_end = last_start if last_start > head_len else n
    if shared_end <= head_len:
        return None
    return AgentSplit(head_agent_id(ids[:head_len]), head_len, shared_end)


def explicit_split(ids: Sequence[int], custom_params: Mapping | None) -> AgentSplit | None:
    """The split named by a request's ``custom_params``, or None if it names none.

    Raises:
        ValueError: if the fields are present but inconsistent with the prompt.
    """
    if not custom_params or HEAD_LEN_FIELD not in custom_params:
        return None
    head_len = int(custom_params[HEAD_LEN_FIELD])
    shared_end = int(custom_params.get(SHARED_END_FIELD, len(ids)))
    if not 0 < head_len <= shared_end <= len(ids):
        raise ValueError(
            f"{HEAD_LEN_FIELD}={head_len}, {SHARED_END_FIELD}={shared_end} do not fit a prompt of "
            f"{len(ids)} tokens"
        )
    name = custom_params.get(AGENT_FIELD)
    agent = f"name:{name}" if name else head_agent_id(ids[:head_len])
    return AgentSplit(agent, head_len, shared_end)


def split_request(
    ids: Sequence[int], custom_params: Mapping | None, chat: ChatTemplateIds | None
) -> AgentSplit | None:
    """Explicit split if given, else ChatML detection, else None (not an agent request)."""
    split = explicit_split(ids, custom_params)
    if split is not None:
        return split
    return detect_chatml_split(ids, chat) if chat is not None else None

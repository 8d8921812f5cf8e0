"""The token markers of a chat template that delimit an agent's head, derived from the template.

A chat template is rendered (through any ``render`` callable: a Jinja template, SGLang's named
conversation templates) on probe conversations whose contents are sentinels, and the rendered
prompts are tokenized by the served tokenizer. Comparing the token ids of probes that differ in
one content gives, as token ids, with no template hard-coded:

- ``system_open``: what every prompt with a system turn starts with, up to the system text
  (BOS, turn opener, role name);
- ``head_sep``: the tokens between the system text and the next turn's text; its first
  ``head_keep`` tokens close the system turn (they end the head), the rest open the next turn;
- ``generation_open``: what ``add_generation_prompt=True`` appends (the assistant opener).

The split point inside ``head_sep`` is where the next turn's opener starts: the position whose
tokens share the longest prefix with ``generation_open`` (a turn opener starts like the assistant
opener, only the role differs); with nothing shared the whole separator is head. ChatML:
``<|im_end|>\\n`` | ``<|im_start|>user\\n``; Llama-3: ``<|eot_id|>`` | ``<|start_header_id|>user
<|end_header_id|>\\n\\n``.

Templates with no system role (Gemma folds the system text into the first user turn; Mistral's
``[INST]`` likewise) have as head the first turn's opener, the system text and the separator the
template puts between system and user text (``"\\n\\n"`` for both). Limits, for those templates:
a system text that itself contains the separator ends the head early (the agent is then its text
up to there); a prompt with no system message whose first user text contains the separator is
taken as having a head (its first paragraph). For every template, the head is found by token ids,
so a tokenizer that tokenizes the separator differently next to some texts (markers that are not
special tokens) misses those prompts: they are served by prefix caching alone. Derivation checks
itself on its probes (several system endings) and gives None when no split holds.

Pure Python (``render`` and ``encode`` are given); detection is in ``agent_split``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

Message = dict[str, str]
Render = Callable[[list[Message], bool], str]
"""``render(messages, add_generation_prompt) -> prompt text``."""
Encode = Callable[[str], list[int]]
"""``encode(prompt text) -> token ids`` (no special tokens added: the template places them)."""

# Sentinel contents: distinct first and last words so that probes differ exactly in one content.
_SYSTEMS = ("Alpha keeps notes", "Bravo checks sums")
_SYSTEM_ENDINGS = ("", ".", "!", "?")
_USERS = ("Kilo asks first", "Lima asks again")
_ASSISTANT = "Mike answers"


@dataclass(frozen=True)
class TemplateMarkers:
    """Token ids that delimit the agent head, the shared transcript and the suffix of a prompt
    (the fields as in the module docstring; ``generation_open`` may be empty). ``name``: where
    the template came from (for logs), e.g. ``"tokenizer"`` or a file name."""

    name: str
    system_open: tuple[int, ...]
    head_sep: tuple[int, ...]
    head_keep: int
    generation_open: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.system_open or not self.head_sep:
            raise ValueError(f"template markers {self.name!r}: system_open and head_sep must "
                             "not be empty")
        if not 0 <= self.head_keep <= len(self.head_sep):
            raise ValueError(f"template markers {self.name!r}: head_keep={self.head_keep} out "
                             f"of [0, {len(self.head_sep)}]")

    @property
    def head_close(self) -> tuple[int, ...]:
        """The ids detection looks for after the system text: the system close (the head ends
        at its end), or the whole separator when the close is empty (the head ends
        ``head_keep`` = 0 ids into it)."""
        return self.head_sep[: self.head_keep] if self.head_keep else self.head_sep

    @classmethod
    def chatml(cls, im_start: int, im_end: int, newline: int, system: Sequence[int],
               user: Sequence[int], assistant: Sequence[int]) -> TemplateMarkers:
        """ChatML (``<|im_start|>ROLE\\n TEXT <|im_end|>\\n``) from its token ids (each role
        name's ids); what :func:`derive_markers` finds for a ChatML template."""
        return cls("chatml", (im_start, *system, newline),
                   (im_end, newline, im_start, *user, newline), 2,
                   (im_start, *assistant, newline))


def derive_markers(render: Render, encode: Encode,
                   name: str = "template") -> TemplateMarkers | None:
    """The markers of the template ``render`` renders, tokenized by ``encode``.

    Returns None when the template renders no system text, when probes that differ in one
    content do not differ in exactly that place, or when the markers found do not split every
    probe (several system text endings) where its rendering says. Exceptions of ``render``
    (a template that refuses a system message) also give None.
    """
    try:
        return _derive(render, encode, name)
    except Exception:  # noqa: BLE001 - any template error means: no markers
        return None


def _derive(render: Render, encode: Encode, name: str) -> TemplateMarkers | None:
    def ids(system: str, users: Sequence[str], gen: bool = False) -> list[int]:
        msgs = [{"role": "system", "content": system}]
        for i, u in enumerate(users):
            if i:
                msgs.append({"role": "assistant", "content": _ASSISTANT})
            msgs.append({"role": "user", "content": u})
        return list(encode(render(msgs, gen)))

    base = ids(_SYSTEMS[0], _USERS[:1])
    if _SYSTEMS[0] not in render([{"role": "system", "content": _SYSTEMS[0]},
                                  {"role": "user", "content": _USERS[0]}], False):
        return None  # the template drops system text
    open_len = _common_prefix(base, ids(_SYSTEMS[1], _USERS[:1]))
    with_gen = ids(_SYSTEMS[0], _USERS[:1], gen=True)
    generation_open = with_gen[_common_prefix(base, with_gen):]  # what the generation prompt adds
    seps, sys_ends = [], []
    for ending in _SYSTEM_ENDINGS:
        system = _SYSTEMS[0] + ending
        full = ids(system, _USERS[:1])
        sys_end = len(full) - _common_suffix(full, ids(_SYSTEMS[1] + ending, _USERS[:1]))
        user_start = _common_prefix(full, ids(system, _USERS[1:2]))
        if not open_len < sys_end <= user_start:
            return None
        seps.append(full[sys_end:user_start])
        sys_ends.append(sys_end)
    # The separator's first ids may merge with the system text's last characters: keep the
    # part every ending shares.
    common = min(_common_suffix(seps[0], s) for s in seps)
    sep = seps[0][len(seps[0]) - common:]
    keep = _head_keep(seps[0], generation_open) - (len(seps[0]) - common)
    if not sep or keep < 0:
        return None
    markers = TemplateMarkers(name, tuple(base[:open_len]), tuple(sep), keep,
                              tuple(generation_open))
    # Per system ending: how many separator ids precede the common part.
    drops = [len(s) - common for s in seps]
    return markers if _self_check(markers, ids, drops) else None


def _head_keep(sep: list[int], generation_open: list[int]) -> int:
    """Where the next turn's opener starts in ``sep``: the position sharing the longest prefix
    with the generation opener (the last such); ``len(sep)`` when none shares a token."""
    best, where = 0, len(sep)
    for k in range(len(sep)):
        m = _common_prefix(sep[k:], generation_open)
        if m and m >= best:
            best, where = m, k
    return where


def _self_check(markers: TemplateMarkers, ids: Callable[..., list[int]],
                drops: Sequence[int]) -> bool:
    """Every probe (1 to 3 user turns, each system ending) splits where its rendering says: the
    head ends ``head_keep`` ids into the separator after the system text and is the same ids
    for every number of turns, the shared transcript ends where the generation opener starts."""
    from sglang_kvcmas.tree.agent_split import detect_template_split  # cycle: agent_split uses us

    for ending, drop in zip(_SYSTEM_ENDINGS, drops):
        system = _SYSTEMS[0] + ending
        first_head = None
        for turns in (1, 2, 3):
            users = [f"{_USERS[t % 2]} {t}" for t in range(turns)]
            prompt = ids(system, users, gen=True)
            other = ids(_SYSTEMS[1] + ending, users, gen=True)
            head = len(prompt) - _common_suffix(prompt, other)
            split = detect_template_split(prompt, markers)
            if split is None or split.head_len != head + drop + markers.head_keep:
                return False
            if split.shared_end != len(prompt) - len(markers.generation_open):
                return False
            # The head is the same ids whatever turns follow (a template that renders the
            # system text late, e.g. into the last user turn, has no head).
            head_ids = prompt[: split.head_len]
            if first_head is not None and head_ids != first_head:
                return False
            first_head = head_ids
    return True


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _common_suffix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[len(a) - 1 - i] == b[len(b) - 1 - i]:
        i += 1
    return i

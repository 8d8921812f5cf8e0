"""The served chat template, resolved as SGLang resolves it, and its head markers.

SGLang's OpenAI chat route renders ``messages`` with (``TemplateManager.load_chat_template``):

1. ``--chat-template NAME`` of one of SGLang's named conversation templates
   (``sglang.srt.parser.conversation``), rendered by ``Conversation.get_prompt`` to text that
   the tokenizer manager tokenizes;
2. ``--chat-template FILE.jinja``: the file's text (``\\n`` escapes turned into newlines) replaces
   the tokenizer's ``chat_template``;
3. no flag: a named template matched from the model path if any, else the tokenizer's own Jinja
   template.

:func:`markers_for_server` renders that same template on probe messages
(``tree.template_markers.derive_markers``) in each scheduler, so raw ``/generate`` prompts
rendered by it are split too. Templates SGLang renders in Python (``--chat-template`` of a
Python template name) or loads from JSON are not probed: no template detection (requests may
still name their head explicitly). The outcome is logged once per process.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from sglang_kvcmas.tree.template_markers import Message, Render, TemplateMarkers, derive_markers

logger = logging.getLogger(__name__)


def read_jinja_file(path: str) -> str:
    """A ``--chat-template`` Jinja file's text, as SGLang loads it."""
    with open(path) as f:
        return "".join(f.readlines()).strip("\n").replace("\\n", "\n")


def jinja_render(tokenizer: Any, template: str | None = None) -> Render:
    """``render(messages, add_generation_prompt)`` through the tokenizer's Jinja renderer, with
    ``template`` (None: the tokenizer's own)."""

    def render(messages: list[Message], add_generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)

    return render


def conversation_render(name: str) -> Render:
    """``render(messages, add_generation_prompt)`` through SGLang's named conversation template
    (as ``generate_chat_conv`` fills it: the system message, then user / assistant turns, then a
    blank assistant turn for the generation prompt)."""
    from sglang.srt.parser.conversation import chat_templates

    def render(messages: list[Message], add_generation_prompt: bool) -> str:
        conv = chat_templates[name].copy()
        for m in messages:
            if m["role"] == "system":
                conv.set_system_message(m["content"])
            else:
                conv.append_message(conv.roles[0 if m["role"] == "user" else 1], m["content"])
        if add_generation_prompt:
            conv.append_message(conv.roles[1], None)
        return conv.get_prompt()

    return render


def resolve_render(tokenizer: Any, chat_template: str | None,
                   model_path: str | None) -> tuple[str, Render, bool] | None:
    """``(name, render, encode_adds_specials)`` of the template SGLang serves, or None when
    SGLang renders it by other means (a Python or JSON template).

    ``encode_adds_specials``: prompts of that template reach the scheduler as text, tokenized
    with the tokenizer's special tokens (named templates); Jinja prompts as ids without.
    """
    from sglang.srt.parser.conversation import (
        chat_template_exists,
        get_conv_template_by_model_path,
    )

    if chat_template:
        if chat_template_exists(chat_template):
            return chat_template, conversation_render(chat_template), True
        if chat_template.endswith(".jinja") and os.path.exists(chat_template):
            return (os.path.basename(chat_template),
                    jinja_render(tokenizer, read_jinja_file(chat_template)), False)
        return None
    named = get_conv_template_by_model_path(model_path) if model_path else None
    if named is not None:
        return named, conversation_render(named), True
    if getattr(tokenizer, "chat_template", None):
        return "tokenizer", jinja_render(tokenizer), False
    return None


def markers_for_tokenizer(tokenizer: Any, chat_template: str | None = None,
                          model_path: str | None = None) -> TemplateMarkers | None:
    """The head markers of the template SGLang serves with ``tokenizer``, or None."""
    resolved = resolve_render(tokenizer, chat_template, model_path)
    if resolved is None:
        return None
    name, render, specials = resolved
    encode: Callable[[str], list[int]] = lambda text: list(
        tokenizer.encode(text, add_special_tokens=specials))
    return derive_markers(render, encode, name)


def markers_for_server(args: Any) -> TemplateMarkers | None:
    """The head markers for a server's ``ServerArgs`` (tokenizer, ``--chat-template``), logged
    once; None (no template detection) when there is no tokenizer or no split derives."""
    path = getattr(args, "tokenizer_path", None) or getattr(args, "model_path", None)
    if not path:
        return None
    chat_template = getattr(args, "chat_template", None)
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(
            path, trust_remote_code=bool(getattr(args, "trust_remote_code", False)))
        markers = markers_for_tokenizer(tokenizer, chat_template,
                                        getattr(args, "model_path", None))
    except Exception as e:  # noqa: BLE001 - no detection is a served state, not a failure
        logger.warning("sglang-kvcmas: no agent detection from the chat template (%s: %s); "
                       "requests name their head explicitly", type(e).__name__, e)
        return None
    if markers is None:
        logger.warning("sglang-kvcmas: no agent head derives from the chat template (%s); "
                       "prompts are served by prefix caching unless they name their head "
                       "(custom_params.kvcmas_head_len)", chat_template or "the tokenizer's")
    else:
        logger.info("sglang-kvcmas: agent detection from chat template %r: system opener %d "
                    "ids, head separator %d ids (%d in the head), generation opener %d ids",
                    markers.name, len(markers.system_open), len(markers.head_sep),
                    markers.head_keep, len(markers.generation_open))
    return markers

"""The OpenAI chat route names each request's agent head from its messages.

AROUND ``OpenAIServingChat._convert_to_internal_request`` (the HTTP process, where SGLang turns
``messages`` into token ids): with the messages known, the head is the rendering of the leading
system message(s) with the served template, as token ids, where that rendering is a token prefix
of the prompt: exactly, or up to the last id the two tokenizations share when the system turn's
close merges with the next turn's opener into one token (markers that are not special tokens),
provided that prefix still holds every system text. The shared transcript ends where the
generation prompt starts (the template's ``generation_open``, derived once per route from the
same template; without it, at the prompt's end). Both go on the request as explicit
``custom_params.kvcmas_head_len`` / ``kvcmas_shared_end``, which the scheduler honours exactly as
on ``/generate``.

Left alone (the scheduler's template detection still applies): requests that name any of those
fields or ``kvcmas_agent`` themselves (``extra_body={"custom_params": {...}}`` reaches the
scheduler unchanged), prompts SGLang sends as text (named conversation templates, multimodal),
system turns whose rendering holds no system text (Gemma, Mistral ``[INST]``: the system text is
rendered inside the first user turn), servers without our tree cache with sharing on. Any error
here leaves the request as SGLang built it.
"""

from __future__ import annotations

import logging
from typing import Any

from sglang_kvcmas.config import ServingConfig
from sglang_kvcmas.integration.chat_template_markers import jinja_render
from sglang_kvcmas.integration.radix_cache_backend import BACKEND_NAME
from sglang_kvcmas.policy.request_options import AGENT_FIELD, HEAD_LEN_FIELD, SHARED_END_FIELD
from sglang_kvcmas.tokens import as_token_array, common_prefix
from sglang_kvcmas.tree.agent_split import shared_end_after
from sglang_kvcmas.tree.template_markers import TemplateMarkers, derive_markers

TARGET = ("sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat."
          "_convert_to_internal_request")

logger = logging.getLogger(__name__)

_UNSET = object()


def convert_around(original: Any, serving: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook: SGLang's conversion, then the messages' split set on the request."""
    result = original(serving, request, *args, **kwargs)
    try:
        apply_message_split(serving, request, result[0])
    except Exception:  # never fail a request over its split
        logger.debug("sglang-kvcmas: no message split for a chat request", exc_info=True)
    return result


def _active(serving: Any) -> bool:
    """Sharing is on in our tree cache (read once per route object)."""
    active = getattr(serving, "_kvcmas_split_active", None)
    if active is None:
        args = getattr(getattr(serving, "tokenizer_manager", None), "server_args", None)
        active = (getattr(args, "radix_cache_backend", None) == BACKEND_NAME
                  and ServingConfig.from_env().share_context)
        serving._kvcmas_split_active = active
    return active


def _generation_open(serving: Any, tokenizer: Any) -> tuple[int, ...]:
    """The served template's generation opener (derived once per route object)."""
    markers = getattr(serving, "_kvcmas_markers", _UNSET)
    if markers is _UNSET:
        markers = derive_markers(jinja_render(tokenizer),
                                 lambda t: tokenizer.encode(t, add_special_tokens=False),
                                 "chat route")
        serving._kvcmas_markers = markers
    return markers.generation_open if isinstance(markers, TemplateMarkers) else ()


def system_messages(messages: Any) -> list[dict[str, str]]:
    """The leading system messages with text content, as template messages."""
    out = []
    for m in messages or ():
        role = getattr(m, "role", None)
        content = getattr(m, "content", None)
        if role != "system" or not isinstance(content, str):
            break
        out.append({"role": "system", "content": content})
    return out


def message_head_len(prompt_ids: Any, system_ids: Any, system_texts: list[str],
                     decode: Any) -> int | None:
    """The head length: the common prefix of the system rendering's ids and the prompt's, when
    its text holds every system text (``decode(ids) -> str``); else None."""
    prompt = as_token_array(prompt_ids)
    head_len = common_prefix(as_token_array(system_ids), prompt)
    if head_len <= 0 or head_len >= prompt.shape[0]:
        return None
    head_text = decode(list(prompt_ids[:head_len]))
    if not all(t.strip() in head_text for t in system_texts):
        return None
    return head_len


def apply_message_split(serving: Any, request: Any, adapted: Any) -> None:
    """Set ``kvcmas_head_len`` / ``kvcmas_shared_end`` on ``adapted`` (SGLang's
    ``GenerateReqInput``) from ``request``'s messages, where that applies (module docstring)."""
    if not _active(serving) or serving.template_manager.chat_template_name is not None:
        return
    params = adapted.sampling_params
    ids = adapted.input_ids
    if not isinstance(params, dict) or not isinstance(ids, list) or not ids \
            or not isinstance(ids[0], int):  # ids[0] a list: a batch of prompts
        return
    custom = params.get("custom_params")
    if custom is not None and (not isinstance(custom, dict) or any(
            f in custom for f in (HEAD_LEN_FIELD, SHARED_END_FIELD, AGENT_FIELD))):
        return
    systems = system_messages(request.messages)
    if not systems:
        return
    tokenizer = serving.tokenizer_manager.tokenizer
    kwargs = dict(request.chat_template_kwargs or {})
    text = tokenizer.apply_chat_template(systems, tokenize=False, add_generation_prompt=False,
                                         **kwargs)
    head_len = message_head_len(ids, tokenizer.encode(text, add_special_tokens=False),
                                [m["content"] for m in systems],
                                lambda i: tokenizer.decode(
                                    i, clean_up_tokenization_spaces=False))
    if head_len is None:
        return
    shared_end = shared_end_after(ids, head_len, _generation_open(serving, tokenizer))
    if shared_end is None:
        return
    params["custom_params"] = {**(custom or {}), HEAD_LEN_FIELD: head_len,
                               SHARED_END_FIELD: shared_end}

"""Agent detection for any chat template: markers derived from the template itself, exact head /
shared / suffix boundaries on 2-4 turn conversations (ChatML, Llama-3, Gemma, Mistral-style
templates rendered with the embedded tokenizer), raw ``/generate`` text prompts, and the chat
route's split from the request's messages."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))

from chat_templates import GEMMA, LLAMA3, MISTRAL  # noqa: E402

from sglang_kvcmas.integration import chat_split_hook  # noqa: E402
from sglang_kvcmas.integration.chat_template_markers import (  # noqa: E402
    markers_for_tokenizer,
    resolve_render,
)
from sglang_kvcmas.tree.agent_split import (  # noqa: E402
    detect_template_split,
    find_first,
    find_first_reference,
    shared_end_after,
)
from sglang_kvcmas.tree.template_markers import TemplateMarkers, derive_markers  # noqa: E402
from sglang_kvcmas.tokens import as_token_array  # noqa: E402

SYS_A = "You are Ada, a careful mathematician. Check every step."
SYS_B = "You are Ben, a skeptical reviewer! Find the one likely mistake"
TURNS = [
    ("user", "Question: a farmer has 17 sheep, buys 5 and sells 3. How many are left?"),
    ("assistant", "He has 17 + 5 - 3 = 19 sheep."),
    ("user", "Ben says 20. Who is right, and why?"),
    ("assistant", "Ada is right: 19."),
    ("user", "Cleo agrees with Ada. Give the final answer."),
]

# Per template: the head's text (BOS is the embedded tokenizer's <|im_start|>; SYS is the system
# text) and the suffix's text. Llama-3's markers are no special tokens here: "|><|" tokenizes
# as "|", "><", "|", so the head ends inside "<|eot_id|>" and the suffix starts with "><".
EXPECTED = {
    "chatml": ("<|im_start|>system\n{SYS}<|im_end|>\n", "<|im_start|>assistant\n"),
    "llama3": ("<|im_start|><|start_header_id|>system<|end_header_id|>\n\n{SYS}<|eot_id|",
               "><|start_header_id|>assistant<|end_header_id|>\n\n"),
    "gemma": ("<|im_start|><start_of_turn>user\n{SYS}\n\n", "<start_of_turn>model\n"),
    "mistral": ("<|im_start|> [INST] {SYS}\n\n", ""),
}
TEMPLATES = {"chatml": None, "llama3": LLAMA3, "gemma": GEMMA, "mistral": MISTRAL}


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from sglang_kvcmas.models.resolve import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path(None))


@pytest.fixture(scope="module")
def markers(tokenizer):
    own = tokenizer.chat_template
    out = {}
    for name, template in TEMPLATES.items():
        tokenizer.chat_template = template or own
        out[name] = markers_for_tokenizer(tokenizer)
    tokenizer.chat_template = own
    return out


def render(tokenizer, name, system, turns, gen=True):
    msgs = [{"role": "system", "content": system}] + [{"role": r, "content": c} for r, c in turns]
    return tokenizer.apply_chat_template(msgs, chat_template=TEMPLATES[name] or
                                         tokenizer.chat_template, tokenize=False,
                                         add_generation_prompt=gen)


def prompt_ids(tokenizer, name, system, turns, gen=True):
    return tokenizer.encode(render(tokenizer, name, system, turns, gen), add_special_tokens=False)


def test_chatml_markers_are_derived_from_the_tokenizers_own_template(tokenizer, markers):
    ids = tokenizer.convert_tokens_to_ids
    enc = lambda t: tuple(tokenizer.encode(t, add_special_tokens=False))  # noqa: E731
    expected = TemplateMarkers.chatml(ids("<|im_start|>"), ids("<|im_end|>"), enc("\n")[0],
                                      enc("system"), enc("user"), enc("assistant"))
    got = markers["chatml"]
    assert (got.system_open, got.head_sep, got.head_keep, got.generation_open) == (
        expected.system_open, expected.head_sep, expected.head_keep, expected.generation_open)


@pytest.mark.parametrize("name", list(TEMPLATES))
@pytest.mark.parametrize("n_turns", [1, 3, 5])  # 1 to 3 user turns, 2 to 4 turns with system
def test_exact_head_shared_suffix_per_template(tokenizer, markers, name, n_turns):
    turns = TURNS[:n_turns]
    ids = prompt_ids(tokenizer, name, SYS_A, turns)
    split = detect_template_split(ids, markers[name])
    head_text, suffix_text = EXPECTED[name]
    decode = lambda x: tokenizer.decode(x, clean_up_tokenization_spaces=False)  # noqa: E731
    assert decode(ids[: split.head_len]) == head_text.format(SYS=SYS_A)
    assert decode(ids[split.shared_end:]) == suffix_text
    assert split.shared_end == len(ids) - len(markers[name].generation_open)
    # The head is the same token prefix whatever follows it: the same agent every turn.
    first = detect_template_split(prompt_ids(tokenizer, name, SYS_A, TURNS[:1]), markers[name])
    assert split.agent == first.agent and split.head_len == first.head_len


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_agents_share_the_transcript_tokens(tokenizer, markers, name):
    """Two agents (system prompts) over one transcript: their shared parts are the same token
    ids, and each turn's shared part is a token prefix of the next turn's."""
    m = markers[name]
    a3 = prompt_ids(tokenizer, name, SYS_A, TURNS[:3])
    b3 = prompt_ids(tokenizer, name, SYS_B, TURNS[:3])
    a5 = prompt_ids(tokenizer, name, SYS_A, TURNS[:5])
    sa3, sb3, sa5 = (detect_template_split(x, m) for x in (a3, b3, a5))
    assert sa3.agent != sb3.agent
    shared_a3 = a3[sa3.head_len : sa3.shared_end]
    assert shared_a3 == b3[sb3.head_len : sb3.shared_end]
    assert a5[sa5.head_len : sa5.head_len + len(shared_a3)] == shared_a3


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_raw_generate_text_prompt_is_detected(tokenizer, markers, name):
    """A prompt rendered by the template and sent as text to ``/generate`` is tokenized there
    with the tokenizer's defaults: detected the same."""
    text = render(tokenizer, name, SYS_A, TURNS[:3])
    by_text = detect_template_split(tokenizer(text)["input_ids"], markers[name])
    by_ids = detect_template_split(prompt_ids(tokenizer, name, SYS_A, TURNS[:3]), markers[name])
    assert by_text == by_ids


def test_prompt_without_a_system_turn_is_no_agent(tokenizer, markers):
    for name in ("chatml", "llama3"):
        msgs = [{"role": r, "content": c} for r, c in TURNS[:3]]
        text = tokenizer.apply_chat_template(msgs, chat_template=TEMPLATES[name] or
                                             tokenizer.chat_template, tokenize=False,
                                             add_generation_prompt=True)
        ids = tokenizer.encode(text, add_special_tokens=False)
        split = detect_template_split(ids, markers[name])
        if name == "chatml":  # SmolLM2's template adds its default system prompt: that agent
            assert "SmolLM" in tokenizer.decode(ids[: split.head_len])
        else:
            assert split is None


def test_doubled_bos_is_tolerated():
    m = TemplateMarkers("t", (1, 9, 5), (2, 5), 2, (1, 8, 5))
    ids = [1, 9, 5, 40, 41, 2, 5, 1, 7, 5, 50, 2, 5, 1, 8, 5]
    one = detect_template_split(ids, m)
    two = detect_template_split([1] + ids, m)
    assert (one.head_len, one.shared_end) == (7, 13)
    assert (two.head_len, two.shared_end) == (8, 14)
    assert detect_template_split([3] + ids, m) is None


def test_template_without_a_split_gives_none(tokenizer):
    drops_system = ("{% for m in messages %}{% if m['role'] != 'system' %}<|im_start|>"
                    "{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
                    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    last_user = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}"
                 "{% if loop.last %}[INST] {{ messages[0]['content'] }}\n\n{% else %}[INST] "
                 "{% endif %}{{ m['content'] }}[/INST]{% elif m['role'] == 'assistant' %}"
                 "{{ m['content'] }}{% endif %}{% endfor %}")  # Mistral v0.3: system last
    for template in (drops_system, last_user, "{{ raise_exception('no') }}"):
        r = lambda msgs, gen, t=template: tokenizer.apply_chat_template(  # noqa: E731
            msgs, chat_template=t, tokenize=False, add_generation_prompt=gen)
        assert derive_markers(r, lambda s: tokenizer.encode(s, add_special_tokens=False)) is None


def test_chat_template_flag_resolves_like_sglang(tokenizer, tmp_path):
    path = tmp_path / "llama3.jinja"
    path.write_text(LLAMA3)
    name, r, specials = resolve_render(tokenizer, str(path), None)
    assert name == "llama3.jinja" and not specials
    assert r([{"role": "user", "content": "x"}], True).endswith("assistant<|end_header_id|>\n\n")
    named = markers_for_tokenizer(tokenizer, "chatml")  # SGLang's named conversation template
    assert named is not None and named.name == "chatml"
    own = markers_for_tokenizer(tokenizer)
    assert (named.system_open, named.head_close) == (own.system_open, own.head_close)
    assert resolve_render(tokenizer, "not-a-template", None) is None


def test_find_first_matches_its_reference():
    arr = as_token_array([5, 1, 2, 1, 2, 3, 1, 2, 3, 9])
    for pattern, start in (([1, 2, 3], 0), ([1, 2, 3], 6), ([1, 2, 3], 7), ([2], 3), ([4], 0)):
        assert find_first(arr, pattern, start) == find_first_reference(list(arr), pattern, start)


def test_shared_end_is_the_last_generation_opener_past_the_head():
    gen = (1, 8, 5)
    assert shared_end_after([0, 0, 7, 1, 8, 5], 2, gen) == 3  # ends with the opener
    assert shared_end_after([0, 0, 7, 1, 8, 5, 44, 45], 2, gen) == 3  # assistant prefill
    assert shared_end_after([0, 0, 1, 8, 5, 7, 7], 2, gen) == 7  # opener at the head: the end
    assert shared_end_after([0, 0, 7, 7], 2, ()) == 4
    assert shared_end_after([0, 0], 2, gen) is None


# ----- the chat route: the split from the request's messages ---------------------------------


def _route(tokenizer, monkeypatch, share="1"):
    monkeypatch.setenv("KVCMAS_SHARE_CONTEXT", share)
    return SimpleNamespace(
        tokenizer_manager=SimpleNamespace(
            tokenizer=tokenizer, server_args=SimpleNamespace(radix_cache_backend="kvcmas")),
        template_manager=SimpleNamespace(chat_template_name=None))


def _request(system, turns, custom=None):
    msgs = [SimpleNamespace(role="system", content=system)] + [
        SimpleNamespace(role=r, content=c) for r, c in turns]
    return (SimpleNamespace(messages=msgs, chat_template_kwargs=None),
            {"custom_params": custom} if custom is not None else {})


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_chat_route_sets_the_messages_split(tokenizer, markers, monkeypatch, name):
    own = tokenizer.chat_template
    tokenizer.chat_template = TEMPLATES[name] or own
    try:
        route = _route(tokenizer, monkeypatch)
        ids = prompt_ids(tokenizer, name, SYS_A, TURNS[:3])
        request, params = _request(SYS_A, TURNS[:3])
        chat_split_hook.apply_message_split(route, request, SimpleNamespace(
            sampling_params=params, input_ids=ids))
    finally:
        tokenizer.chat_template = own
    detected = detect_template_split(ids, markers[name])
    custom = params.get("custom_params")
    if name in ("gemma", "mistral"):  # the system rendering holds no system text: left alone
        assert custom is None
        return
    # The system turn's rendering is a token prefix of the prompt (up to the id it shares with
    # the next turn's opener), and the same split the template's markers find.
    system_ids = tokenizer.encode(render(tokenizer, name, SYS_A, [], gen=False),
                                  add_special_tokens=False)
    head = custom["kvcmas_head_len"]
    assert ids[:head] == system_ids[:head] and head >= len(system_ids) - 1
    assert (head, custom["kvcmas_shared_end"]) == (detected.head_len, detected.shared_end)


def test_chat_route_keeps_explicit_fields_and_is_inert_without_sharing(tokenizer, monkeypatch):
    route = _route(tokenizer, monkeypatch)
    ids = prompt_ids(tokenizer, "chatml", SYS_A, TURNS[:1])
    request, params = _request(SYS_A, TURNS[:1], {"kvcmas_head_len": 4, "other": 1})
    chat_split_hook.apply_message_split(route, request, SimpleNamespace(
        sampling_params=params, input_ids=ids))
    assert params["custom_params"] == {"kvcmas_head_len": 4, "other": 1}
    request, params = _request(SYS_A, TURNS[:1], {"other": 1})
    chat_split_hook.apply_message_split(route, request, SimpleNamespace(
        sampling_params=params, input_ids=ids))
    assert params["custom_params"]["other"] == 1 and params["custom_params"]["kvcmas_head_len"]
    off = _route(tokenizer, monkeypatch, share="0")
    request, params = _request(SYS_A, TURNS[:1])
    chat_split_hook.apply_message_split(off, request, SimpleNamespace(
        sampling_params=params, input_ids=ids))
    assert params == {}

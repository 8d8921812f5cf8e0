"""Agent detection: the ChatML system turn is the head (ChatML markers written out; other
templates: ``test_template_markers.py``); explicit fields for /generate."""

from __future__ import annotations

import pytest

from sglang_kvcmas.tree.agent_split import (
    detect_template_split,
    explicit_split,
    split_request,
)
from sglang_kvcmas.tree.template_markers import TemplateMarkers
from sglang_kvcmas.policy.request_options import RequestOptionError, RequestOptions

CHAT = TemplateMarkers.chatml(im_start=1, im_end=2, newline=198, system=(9690,), user=(4093,),
                              assistant=(520, 9531))
# <|im_start|>system\nYou are A.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n
IDS = [1, 9690, 198, 2683, 359, 330, 30, 2, 198, 1, 4093, 198, 26843, 665, 2, 198, 1, 520, 9531, 198]


def test_chatml_head_shared_suffix():
    s = detect_template_split(IDS, CHAT)
    assert (s.head_len, s.shared_end) == (9, 16)
    assert IDS[s.head_len] == 1 and IDS[s.shared_end : s.shared_end + 2] == [1, 520]


def test_same_system_prompt_is_same_agent():
    other_user = IDS[:12] + [999, 2, 198, 1, 520, 9531, 198]
    assert detect_template_split(IDS, CHAT).agent == detect_template_split(other_user, CHAT).agent
    other_sys = [1, 9690, 198, 77, 2, 198] + IDS[9:]
    assert detect_template_split(IDS, CHAT).agent != detect_template_split(other_sys, CHAT).agent


def test_no_system_turn_is_not_an_agent():
    assert detect_template_split(IDS[9:], CHAT) is None
    assert split_request(IDS[9:], RequestOptions(), CHAT) is None


def _opts(**fields) -> RequestOptions:
    return RequestOptions.parse(fields)


def test_explicit_fields_win_and_are_checked():
    s = split_request(IDS, _opts(kvcmas_agent="solver", kvcmas_head_len=5), CHAT)
    assert s.agent.startswith("name:solver/head:") and (s.head_len, s.shared_end) == (5, len(IDS))
    with pytest.raises(RequestOptionError, match="kvcmas_head_len=99 is past the prompt"):
        explicit_split(IDS, _opts(kvcmas_head_len=99))
    with pytest.raises(RequestOptionError, match="kvcmas_shared_end=30 is past the prompt"):
        explicit_split(IDS, _opts(kvcmas_head_len=3, kvcmas_shared_end=30))


def test_one_name_with_two_heads_is_two_agents():
    """An agent is its name *and* its head: a name sent with another head never reads the
    first head's leaves as its own."""
    one = split_request(IDS, _opts(kvcmas_agent="solver", kvcmas_head_len=5), CHAT)
    other = split_request([1, 9690, 198, 77, 88] + IDS[5:],
                          _opts(kvcmas_agent="solver", kvcmas_head_len=5), CHAT)
    assert one.agent != other.agent

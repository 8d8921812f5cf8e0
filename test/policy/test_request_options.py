"""Request fields: strict parsing that names the field, SGLang's own keys untouched."""

from __future__ import annotations

import math

import pytest

from sglang_kvcmas.policy.request_options import RequestOptionError, RequestOptions


def test_absent_or_foreign_fields_are_no_options():
    assert RequestOptions.parse(None) == RequestOptions()
    assert RequestOptions.parse({"thinking_budget": 5, "other": [1]}) == RequestOptions()


def test_fields_are_typed():
    opts = RequestOptions.parse({"kvcmas_agent": "a", "kvcmas_head_len": 4,
                                 "kvcmas_shared_end": 9, "kvcmas_exact": True,
                                 "kvcmas_workflow": "w1", "kvcmas_recompute_boundary": 0,
                                 "kvcmas_recompute_mass_fraction": 0.25})
    assert (opts.agent, opts.head_len, opts.shared_end, opts.exact, opts.workflow) == (
        "a", 4, 9, True, "w1")
    assert opts.overrides == {"recompute_boundary": 0, "recompute_mass_fraction": 0.25}
    assert not opts.reads_leaves  # own knobs: the owner's KV under them
    assert RequestOptions.parse({"kvcmas_recompute_boundary": 0,
                                 "kvcmas_read_leaves": True}).reads_leaves
    assert RequestOptions.parse(None).reads_leaves
    assert not RequestOptions.parse({"kvcmas_read_leaves": False}).reads_leaves


@pytest.mark.parametrize("custom, field", [
    (5, "custom_params must be an object"),
    ([1], "custom_params must be an object"),
    ("x", "custom_params must be an object"),
    ({"kvcmas_head_len": None}, "custom_params.kvcmas_head_len"),
    ({"kvcmas_head_len": [16]}, "custom_params.kvcmas_head_len"),
    ({"kvcmas_head_len": {}}, "custom_params.kvcmas_head_len"),
    ({"kvcmas_head_len": 1.5}, "custom_params.kvcmas_head_len"),
    ({"kvcmas_head_len": True}, "custom_params.kvcmas_head_len"),
    ({"kvcmas_head_len": 0}, "custom_params.kvcmas_head_len"),
    ({"kvcmas_head_len": -4}, "custom_params.kvcmas_head_len"),
    ({"kvcmas_head_len": 4, "kvcmas_shared_end": None}, "custom_params.kvcmas_shared_end"),
    ({"kvcmas_head_len": 8, "kvcmas_shared_end": 4}, "custom_params.kvcmas_shared_end=4 is before"),
    ({"kvcmas_shared_end": 4}, "custom_params.kvcmas_shared_end needs"),
    ({"kvcmas_agent": "a"}, "custom_params.kvcmas_agent needs"),
    ({"kvcmas_agent": "a" * 10_000, "kvcmas_head_len": 3},
     "custom_params.kvcmas_agent must be 1-128"),
    ({"kvcmas_exact": "yes"}, "custom_params.kvcmas_exact"),
    ({"kvcmas_exact": 1}, "custom_params.kvcmas_exact"),
    ({"kvcmas_read_leaves": "no"}, "custom_params.kvcmas_read_leaves"),
    ({"kvcmas_recompute_mass_fraction": math.nan}, "custom_params.kvcmas_recompute_mass_fraction"),
    ({"kvcmas_recompute_boundary": 10**30 * -1}, "custom_params.kvcmas_recompute_boundary"),
    ({"kvcmas_workflow": ""}, "custom_params.kvcmas_workflow"),
    ({"kvcmas_boundary_tokens": 4}, "unknown field custom_params.kvcmas_boundary_tokens"),
    ({"kvcmas_min_borrowed": 4}, "custom_params.kvcmas_min_borrowed is no longer served"),
])
def test_bad_fields_are_refused_naming_them(custom, field):
    with pytest.raises(RequestOptionError, match=field.replace("[", r"\[")):
        RequestOptions.parse(custom)
    assert RequestOptions.lenient(custom) is None


def test_prompt_bounds():
    opts = RequestOptions.parse({"kvcmas_head_len": 4, "kvcmas_shared_end": 9})
    opts.check_prompt(9)
    with pytest.raises(RequestOptionError, match="past the prompt's end"):
        opts.check_prompt(8)

"""Sharing namespaces and agent ids of LoRA agents (``policy/lora_share.py``)."""

from __future__ import annotations

import pytest

from sglang_kvcmas.policy.lora_share import (
    ADAPTERS,
    caller_extra_key,
    lora_agent,
    sharing_namespace,
)

A, B = "4ee63f2be01d54428eb8e55a637c4c51", "067056debdcd52e8b39a812851a75344"


def test_caller_extra_key_takes_off_the_appended_adapter_id():
    assert caller_extra_key(A, A) is None  # SGLang: (None or "") + lora_id
    assert caller_extra_key("tenant-1" + A, A) == "tenant-1"
    assert caller_extra_key("tenant-1", None) == "tenant-1"
    assert caller_extra_key(None, None) is None


def test_separate_keeps_each_adapter_apart_as_sglang_does():
    assert sharing_namespace(A, None, A, "separate") != sharing_namespace(B, None, B, "separate")


def test_borrow_puts_every_adapter_in_one_namespace_never_with_the_base_model():
    a = sharing_namespace(A, None, A, "borrow")
    b = sharing_namespace(B, "", B, "borrow")
    base = sharing_namespace(None, None, None, "borrow")
    assert a == b == (None, None, ADAPTERS)
    assert base == (None, None) != a


def test_borrow_never_crosses_cache_salt_or_the_callers_extra_key():
    a = sharing_namespace(A, "salt-1", A, "borrow")
    assert a != sharing_namespace(B, "salt-2", B, "borrow")
    assert a == sharing_namespace(B, "salt-1", B, "borrow")
    assert sharing_namespace("t1" + A, None, A, "borrow") \
        != sharing_namespace("t2" + B, None, B, "borrow")


def test_an_unknown_mode_is_refused():
    for gone in ("mixed", "catchup", "rebase"):
        with pytest.raises(ValueError, match="lora_share"):
            sharing_namespace(A, None, A, gone)


def test_two_adapters_behind_one_head_are_two_agents():
    head = "head:0123456789abcdef"
    assert lora_agent(head, None) == head
    assert lora_agent(head, A) != lora_agent(head, B)
    assert lora_agent(head, A).startswith(head)

"""Tenants from credentials (``policy/tenancy.py``) and their scoping of requests where they
enter SGLang (``integration/request_hooks.label_and_check``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from sglang_kvcmas.integration.request_hooks import label_and_check
from sglang_kvcmas.policy.request_options import RequestOptionError
from sglang_kvcmas.policy.tenancy import (
    TENANT_CHARS,
    TENANT_SALT_PREFIX,
    TenancyError,
    scoped_salt,
    scoped_workflow,
    tenant_of,
)

A, B = {"authorization": "Bearer key-a"}, {"authorization": "Bearer key-b"}


def test_a_tenant_is_its_credential_digest_and_never_the_credential():
    a, b = tenant_of(A), tenant_of(B)
    assert a != b and len(a) == TENANT_CHARS and "key" not in a
    assert tenant_of({"authorization": " Bearer key-a "}) == a
    assert tenant_of(None) is None and tenant_of({}) is None
    assert tenant_of({"authorization": "  "}) is None


def test_salts_of_two_tenants_never_meet_whatever_the_body_says():
    a, b = tenant_of(A), tenant_of(B)
    names = {scoped_salt(t, s) for t in (a, b) for s in (None, "x", "shared")}
    assert len(names) == 6  # a body salt only partitions its own tenant
    assert scoped_salt(a, None) == f"{TENANT_SALT_PREFIX}{a}"
    assert scoped_salt(None, "x") == "x" and scoped_salt(None, None) is None
    for forged in (f"{TENANT_SALT_PREFIX}{a}", f"{TENANT_SALT_PREFIX}{a}/x"):
        for tenant in (None, b):
            with pytest.raises(TenancyError, match="may not start with"):
                scoped_salt(tenant, forged)


def test_workflows_are_scoped_and_a_scope_cannot_be_named_without_a_credential():
    a = tenant_of(A)
    assert scoped_workflow(a, "wf") == f"{a}/wf" and scoped_workflow(None, "wf") == "wf"
    assert scoped_workflow(a, None) is None and scoped_workflow(None, "team/wf") == "team/wf"
    with pytest.raises(TenancyError, match="tenant's scope"):
        scoped_workflow(None, f"{a}/wf")


def request(salt=None, custom=None):
    return SimpleNamespace(cache_salt=salt, sampling_params={"custom_params": dict(custom)}
                           if custom is not None else {})


def test_requests_are_scoped_where_they_enter():
    a = tenant_of(A)
    obj = request("s", {"kvcmas_workflow": "wf"})
    (opts,) = label_and_check(obj, A)
    assert obj.cache_salt == f"{TENANT_SALT_PREFIX}{a}/s"
    assert opts.workflow == f"{a}/wf"
    assert obj.sampling_params["custom_params"]["kvcmas_workflow"] == f"{a}/wf"
    keyed = request()
    (opts,) = label_and_check(keyed, {**A, "x-smg-routing-key": "debate-1"})
    assert keyed.cache_salt == f"{TENANT_SALT_PREFIX}{a}" and opts.workflow == f"{a}/debate-1"
    batch = SimpleNamespace(cache_salt=["x", None], sampling_params=[{}, {}])
    label_and_check(batch, A)
    assert batch.cache_salt == [f"{TENANT_SALT_PREFIX}{a}/x", f"{TENANT_SALT_PREFIX}{a}"]
    plain = request("s", {"kvcmas_workflow": "wf"})  # no credential: as sent
    (opts,) = label_and_check(plain, None)
    assert plain.cache_salt == "s" and opts.workflow == "wf"
    bare = request()
    label_and_check(bare, {})
    assert bare.cache_salt is None


def test_forged_scopes_and_long_names_are_refused():
    a = tenant_of(A)
    with pytest.raises(TenancyError):
        label_and_check(request(f"{TENANT_SALT_PREFIX}{a}"), B)
    with pytest.raises(TenancyError):
        label_and_check(request(None, {"kvcmas_workflow": f"{a}/wf"}), None)
    with pytest.raises(RequestOptionError, match="1-128 printable"):
        label_and_check(request(None, {"kvcmas_workflow": "x" * 129}), A)
    (opts,) = label_and_check(request(None, {"kvcmas_workflow": "x" * 128}), A)
    assert len(opts.workflow) == 128 + TENANT_CHARS + 1  # the scheduler's parse accepts it

"""Budgets in the HTTP process: recorded from requests, reported in usage, enforced (no server)."""

from __future__ import annotations

import types

import pytest
from sglang_kvcmas.integration import reuse_accounting as ra
from sglang_kvcmas.integration import workflow_accounting as wa
from sglang_kvcmas.policy.request_options import RequestOptionError, RequestOptions
from sglang_kvcmas.policy.spend_budget import Budget, BudgetExceeded
from sglang_kvcmas.policy.workflow_ledger import Turn, WorkflowLedger
from sglang_kvcmas_bench.forecast_fit import fit


def synthetic_runs(n: int = 16) -> list[list[dict]]:
    """Runs of 2..9 turns, prompts growing with the transcript."""
    runs = []
    for i in range(n):
        transcript, run = 100, []
        for k in range(2 + i % 8):
            out = 40 + (17 * i + 29 * k) % 200
            run.append({"agent": f"a{k % 3}", "prompt_tokens": 80 + transcript,
                        "recomputed": 40 + transcript // 2, "completion_tokens": out})
            transcript += out
        runs.append(run)
    return runs


def finished(workflow: str, recomputed: int, completion: int) -> dict:
    rec = {"workflow": workflow, "agent": "a", "prompt_tokens": recomputed + 10,
           "reused_exact": 10, "reused_factored": 0, "reused_repositioned": 0,
           "recomputed": recomputed, "recomputed_borrowed": 0, "exact_from_leaves": 0}
    return {"meta_info": {"finish_reason": {"type": "stop"}, "completion_tokens": completion,
                          "kvcmas_reuse": [rec]}}


def request(**custom) -> types.SimpleNamespace:
    return types.SimpleNamespace(sampling_params={"custom_params": custom})


@pytest.fixture
def ledger(monkeypatch) -> WorkflowLedger:
    ledger = WorkflowLedger(forecaster=fit(synthetic_runs()))
    monkeypatch.setattr(wa, "LEDGER", ledger)
    monkeypatch.setattr(wa, "_DEFAULT_BUDGET", [None])
    return ledger


def test_budget_fields_reach_usage_and_the_route(ledger):
    wa.admit(request(kvcmas_workflow="wf", kvcmas_budget_tokens=500))
    out = finished("wf", 100, 50)
    wa.observe(out)
    rec = out["meta_info"]["kvcmas_reuse"][0]
    fields = ra.usage_fields([rec])
    assert fields["kvcmas_budget_tokens"] == 500 and fields["kvcmas_budget_spent"] == 150
    assert fields["kvcmas_budget_exceeded"] is False and fields["kvcmas_budget_enforce"] is False
    assert fields["kvcmas_budget_forecast"] >= 150
    assert fields["kvcmas_reused_exact"] == 10  # the reuse fields are still there
    route = ledger.get("wf").to_json(with_turns=True)
    assert route["forecast"]["at_turn"] == 1 and route["forecast"]["total"] >= 150
    assert route["forecast"]["low"] <= route["forecast"]["total"] <= route["forecast"]["high"]
    assert route["budget"] == {"tokens": 500, "enforce": False}
    listed = ledger.snapshot()["workflows"][0]  # the listing shows forecast and budget too
    assert listed["forecast"] == route["forecast"] and listed["budget"] == route["budget"]
    assert "turns" not in listed
    plain = finished("other", 5, 5)  # no budget: no budget fields
    wa.observe(plain)
    assert "kvcmas_budget_tokens" not in ra.usage_fields(plain["meta_info"]["kvcmas_reuse"])


def test_enforced_budget_refuses_the_next_turn_naming_the_workflow(ledger):
    wa.admit(request(kvcmas_workflow="wf-f", kvcmas_budget_tokens=300,
                     kvcmas_budget_enforce=True))
    wa.observe(finished("wf-f", 200, 50))  # 250 spent; the forecast's low end is past 300
    assert ledger.get("wf-f").forecast.low > 300
    with pytest.raises(BudgetExceeded, match=r"workflow 'wf-f' is forecast to spend \d+"):
        wa.admit(request(kvcmas_workflow="wf-f"))
    ledger.forecaster = None  # by spend alone
    wa.admit(request(kvcmas_workflow="wf-x", kvcmas_budget_tokens=300,
                     kvcmas_budget_enforce=True))
    wa.observe(finished("wf-x", 200, 50))
    wa.admit(request(kvcmas_workflow="wf-x"))  # 250 < 300: admitted
    wa.observe(finished("wf-x", 40, 20))  # 310 spent
    with pytest.raises(BudgetExceeded, match=r"workflow 'wf-x' has spent 310 computed tokens"):
        wa.admit(request(kvcmas_workflow="wf-x"))
    wa.admit(request(kvcmas_workflow="wf-y"))  # other workflows go on
    wa.admit(request(kvcmas_workflow="wf-x", kvcmas_budget_tokens=10_000_000))  # raised: admitted
    assert ledger.get("wf-x").budget == Budget(10_000_000, enforce=True)


def test_server_default_budget_applies_to_workflows_without_their_own(ledger, monkeypatch):
    monkeypatch.setattr(wa, "_DEFAULT_BUDGET", [Budget(100, enforce=True)])
    wa.observe(finished("wf-d", 90, 20))
    fields = ra.usage_fields(finished("wf-d", 1, 1)["meta_info"]["kvcmas_reuse"])
    assert "kvcmas_budget_tokens" not in fields  # only records that passed observe carry it
    with pytest.raises(BudgetExceeded, match="budget of 100"):
        wa.admit(request(kvcmas_workflow="wf-d"))
    wa.admit(request(kvcmas_workflow="wf-d", kvcmas_budget_enforce=False))  # its own: warn only


def test_a_missing_or_bad_artifact_gives_no_forecast_and_a_log_line(tmp_path, caplog):
    (tmp_path / "bad.json").write_text("[]")
    for path in (tmp_path / "absent.json", tmp_path / "bad.json"):
        assert wa.load_forecaster(path) is None
    assert "no workflow spend forecasts" in caplog.text
    ledger = WorkflowLedger(forecaster=None)
    ledger.add("w", Turn(0.0, "a", 10, 0, 0, 0, 10, 5))
    assert ledger.get("w").to_json(with_turns=True)["forecast"] is None


def test_budget_request_fields_are_parsed_strictly():
    opts = RequestOptions.parse({"kvcmas_workflow": "w", "kvcmas_budget_tokens": 7,
                                 "kvcmas_budget_enforce": True})
    assert (opts.budget_tokens, opts.budget_enforce, opts.knobs) == (7, True, ())
    for bad in ({"kvcmas_workflow": "w", "kvcmas_budget_tokens": 0},
                {"kvcmas_workflow": "w", "kvcmas_budget_tokens": 1.5},
                {"kvcmas_workflow": "w", "kvcmas_budget_enforce": "yes"}):
        with pytest.raises(RequestOptionError, match="kvcmas_budget"):
            RequestOptions.parse(bad)
    with pytest.raises(RequestOptionError, match="needs a workflow"):
        RequestOptions.parse({"kvcmas_budget_tokens": 5})


def test_fidelity_samples_reach_the_route_and_later_usage(ledger):
    """A workflow's sampled turns (the fidelity monitor's scores) show in the route and in the
    usage of its responses after them; a workflow without samples shows none."""
    from sglang_kvcmas.policy.fidelity import TurnScore

    wa.observe(finished("wf", 100, 50))
    ledger.add_fidelity("wf", TurnScore(16, 15, 3, 0.01))
    ledger.add_fidelity("gone", TurnScore(16, 16, None, 0.0))  # not held: not created
    assert ledger.get("gone") is None
    out = finished("wf", 20, 10)
    wa.observe(out)
    fields = ra.usage_fields(out["meta_info"]["kvcmas_reuse"])
    assert fields["kvcmas_fidelity_turns"] == 1 and fields["kvcmas_fidelity_diverged"] == 1
    assert fields["kvcmas_fidelity_top1_agreement"] == pytest.approx(15 / 16)
    assert fields["kvcmas_fidelity_kl"] == pytest.approx(0.01)
    assert ledger.get("wf").to_json()["fidelity"]["turns"] == 1
    plain = finished("other", 5, 5)
    wa.observe(plain)
    assert "kvcmas_fidelity_turns" not in ra.usage_fields(plain["meta_info"]["kvcmas_reuse"])
    assert ledger.get("other").to_json()["fidelity"] is None

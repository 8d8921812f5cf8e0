"""The recorder's HumanEval coder ↔ reviewer loop: each version is run on the specification's
examples for the reviewer, the loop stops when the reviewer approves and no example fails, and
the last version is graded by the problem's own tests (pass@1 in the sandbox); the examples'
runner itself."""

from __future__ import annotations

from helpers.bench_scripts import load_script
from sglang_kvcmas_bench import accuracy_tasks as tasks
from sglang_kvcmas_examples.datasets import humaneval

rr = load_script("benchmark/serving/record_runs.py")


class ScriptedRun(rr.Run):
    """A run whose agents answer from a script instead of a server."""

    def __init__(self, replies: list[str], question: str, item: dict | None = None):
        super().__init__("code_review", 0, question, "http://unused", 64, 0.0, item)
        self.replies = list(replies)
        self.asked: list[tuple[int, str, str]] = []

    def ask(self, step: int, agent: str, system: str, user: str) -> str:
        self.asked.append((step, agent, user))
        return self.replies.pop(0)


def test_code_review_revises_until_approved_and_grades_the_last_version():
    problem = humaneval()[0]
    wrong = f"```python\n{problem['prompt']}    return False\n```"
    right = f"Here:\n```python\n{problem['prompt']}{problem['canonical_solution']}```"
    run = ScriptedRun([wrong, "It ignores the threshold.", right, "APPROVED"], problem["prompt"],
                      problem)
    out = rr.run_code_review(run)
    assert out["stopped"] == "approved" and out["loops"] == 2
    assert [(s, a) for s, a, _ in run.asked] == [(0, "Coder"), (1, "Reviewer"), (2, "Coder"),
                                                 (3, "Reviewer")]
    assert "It ignores the threshold." in run.asked[2][2]  # the coder sees the review
    assert "return False" in run.asked[2][2]  # and its own first version
    # the reviewer sees each version run on the specification's examples
    assert "1 of 2 examples of the specification fail" in run.asked[1][2]
    assert "Got:\n    False" in run.asked[1][2]
    assert "All 2 examples of the specification pass." in run.asked[3][2]
    assert rr.grade("code_review", out["answer"], problem)
    assert not rr.grade("code_review", rr.code_block(wrong), problem)
    assert not rr.grade("code_review", None, problem)
    # each version with the turns done when it existed: a run shortened there submits it
    assert [t for t, _ in out["versions"]] == [1, 3]
    assert [rr.grade("code_review", a, problem) for _, a in out["versions"]] == [False, True]


def test_a_failing_example_overrules_the_reviewers_approval():
    problem = humaneval()[0]
    wrong = f"```python\n{problem['prompt']}    return False\n```"
    right = f"```python\n{problem['prompt']}{problem['canonical_solution']}```"
    run = ScriptedRun([wrong, "APPROVED", right, "APPROVED"], problem["prompt"], problem)
    out = rr.run_code_review(run)
    assert out["stopped"] == "approved" and out["loops"] == 2  # not after the first approval
    assert "APPROVED" in run.asked[2][2]  # the coder revises after the overruled approval

def test_code_review_stops_after_the_loop_limit_and_gsm8k_kinds_grade_numbers():
    problem = humaneval()[2]
    run = ScriptedRun(["```python\npass\n```", "Wrong."] * rr.MAX_REVIEW_LOOPS, problem["prompt"])
    out = rr.run_code_review(run)
    assert out == {"stopped": "max_loops", "loops": rr.MAX_REVIEW_LOOPS, "answer": "pass",
                   "versions": [[2 * k + 1, "pass"] for k in range(rr.MAX_REVIEW_LOOPS)]}
    assert rr.grade("pal_debate", "18", "18.0") and not rr.grade("debate", None, "18")
    assert rr.plan_runs(3, rr.KIND_SETS["code"]) == [("code_review", i) for i in range(3)]


def test_the_gsm8k_review_loops_share_the_writer_reviewer_schedule():
    run = ScriptedRun(["Final answer: 17", "Wrong total.", "Final answer: 18", "approved"], "Q?")
    out = rr.run_review(run)
    assert out == {"stopped": "approved", "loops": 2, "answer": "18",
                   "versions": [[1, "17"], [3, "18"]]}
    assert [a for _, a, _ in run.asked] == ["Writer", "Reviewer", "Writer", "Reviewer"]
    assert run.asked[2][2].startswith("Question: Q?") and "Wrong total." in run.asked[2][2]
    run = ScriptedRun(["```python\nprint(6 * 7)\n```", "APPROVED"], "Q?")
    out = rr.run_pal_review(run)
    assert out == {"stopped": "approved", "loops": 1, "answer": "42", "versions": [[1, "42"]]}
    assert "printed: 42" in run.asked[1][2]  # the reviewer sees what the program printed


def test_the_examples_runner_reports_passes_failures_crashes_and_absent_examples():
    problems = humaneval()
    p = problems[0]
    assert tasks.humaneval_examples(
        p, f"```python\n{p['prompt']}{p['canonical_solution']}```") == \
        "All 2 examples of the specification pass."
    assert tasks.humaneval_examples(p, "```python\ndef has_close_elements(:\n```").startswith(
        "Running it failed: SyntaxError")
    assert tasks.humaneval_examples(p, "```python\nwhile True: pass\n```", timeout_s=1) == \
        "Running it timed out after 1 s."
    plain = next(q for q in problems if ">>>" not in q["prompt"])  # examples in prose only
    assert tasks.humaneval_examples(plain, plain["prompt"] + plain["canonical_solution"]) == \
        "The specification gives no runnable example; the code runs without error."
    # `f(x) == y` lines with nothing after them must print True; quotes do not matter
    for qid in (65, 108):
        q = problems[qid]
        assert tasks.humaneval_examples(q, q["prompt"] + q["canonical_solution"]).startswith("All")
    assert not tasks.examples_fail("All 12 examples of the specification pass.")
    assert not tasks.examples_fail(tasks.humaneval_examples(
        plain, plain["prompt"] + plain["canonical_solution"]))
    assert tasks.examples_fail(tasks.humaneval_examples(p, "```python\npass\n```"))

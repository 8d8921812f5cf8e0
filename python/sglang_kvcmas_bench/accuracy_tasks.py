"""Multi-agent workflows with ground truth, for the accuracy benchmark.

Two tasks, each a fixed sequence of steps; the agents of one step run concurrently over the same
transcript (every agent's prompt is ``system(its role) + user(task + transcript so far)``, in the
model's own chat template), and after a step its outputs join the transcript:

- ``gsm8k`` — a program-aided debate. Three debaters each write a short Python program that
  prints the answer; each program is run in the sandbox and its output joins the transcript with
  the program. Two rounds; the final answer is the majority of the last round's printed numbers
  (ties: the first debater's). Correct when it equals GSM8K's reference number.
- ``humaneval`` — coder → reviewer → fixer. The coder completes the function, the reviewer
  points out bugs, the fixer writes the final function. pass@1: the fixer's code (with the
  problem's prompt before it when it does not define the function itself) runs the problem's own
  tests (``check(entry_point)``) in the sandbox.

Prompts suit small instruction-tuned code models: the answer is code in one fenced block.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from dataclasses import dataclass, field

from sglang_kvcmas_bench.sandbox import run_python

GSM8K_DEBATERS = {
    "Ada": "You are Ada, a careful Python programmer in a team of three who solve grade-school "
    "math word problems by writing programs.",
    "Ben": "You are Ben, a practical engineer in a team of three who solve math word problems by "
    "writing programs; you check every quantity and unit against the question.",
    "Cleo": "You are Cleo, a skeptical reviewer in a team of three who solve math word problems "
    "by writing programs; you look for the most likely mistake before agreeing.",
}
_GSM8K_ASK = (
    "Write a short Python program that computes the answer to the question and prints only the "
    "final number. Reply with the program in one ```python block and nothing else."
)
_GSM8K_ASK_AGAIN = (
    "These are the team's programs and what they printed. Considering them, write your final "
    "Python program that prints only the final number, in one ```python block and nothing else."
)

HUMANEVAL_ROLES = {
    "Coder": "You are the Coder in a team of three Python developers. You implement functions "
    "exactly to their specification.",
    "Reviewer": "You are the Reviewer in a team of three Python developers. You read a "
    "function's implementation against its specification and point out every bug and missed "
    "edge case, briefly.",
    "Fixer": "You are the Fixer in a team of three Python developers. You write the final, "
    "correct implementation, taking the review into account.",
}
_HE_ASKS = {
    "Coder": "Complete the function. Reply with the whole function in one ```python block.",
    "Reviewer": "Review the Coder's implementation against the specification. List the bugs, "
    "if any, in a few short lines. Do not write code.",
    "Fixer": "Write the final, correct implementation of the function, fixing what the review "
    "found. Reply with the whole function in one ```python block.",
}

_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)(?:```|$)", re.S)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def code_block(text: str) -> str:
    """The last fenced code block of a reply (an unterminated last block counts), or the whole
    reply when it has none."""
    blocks = _FENCE.findall(text)
    return blocks[-1].strip("\n") if blocks else text.strip()


def printed_number(stdout: str) -> str | None:
    """The last number a program printed, normalized (``18.0`` → ``18``; commas dropped)."""
    found = _NUMBER.findall(stdout)
    if not found:
        return None
    raw = found[-1].replace(",", "")
    try:
        value = float(raw)
    except ValueError:
        return None
    if value != value or value in (float("inf"), float("-inf")):
        return None
    return str(int(round(value))) if abs(value - round(value)) < 1e-6 else f"{value:g}"


def same_number(a: str | None, b: str | None) -> bool:
    if a is None or b is None:
        return False
    try:
        return abs(float(a) - float(b)) < 1e-6
    except ValueError:
        return a == b


@dataclass
class Flow:
    """One item's workflow: its steps (agents run together), their prompts and what they said.

    Attributes:
        task: ``gsm8k`` or ``humaneval``.
        item: the item's index in its data set.
        steps: agent names per step.
        outputs: per step, agent → reply text (filled by :meth:`record`).
        executions: per step, agent → printed number (gsm8k) of the agent's program.
    """

    task: str
    item: int
    problem: str
    steps: list[list[str]]
    roles: dict[str, str]
    outputs: list[dict[str, str]] = field(default_factory=list)
    executions: list[dict[str, str | None]] = field(default_factory=list)

    @property
    def key(self) -> str:
        return f"{self.task}/{self.item}"

    def messages(self, step: int, agent: str) -> list[dict]:
        return [{"role": "system", "content": self.roles[agent]},
                {"role": "user", "content": self._user(step, agent)}]

    def _user(self, step: int, agent: str) -> str:
        if self.task == "gsm8k":
            parts = [f"Question: {self.problem}"]
            for s, outs in enumerate(self.outputs):
                parts.append(f"Round {s + 1} programs:")
                for a in self.steps[s]:
                    parts.append(f"{a}:\n```python\n{code_block(outs[a])}\n```\n"
                                 f"printed: {self.executions[s][a]}")
            parts.append(_GSM8K_ASK if step == 0 else _GSM8K_ASK_AGAIN)
            return "\n\n".join(parts)
        parts = [f"Specification:\n```python\n{self.problem}```"]
        for s, outs in enumerate(self.outputs):
            for a in self.steps[s]:
                parts.append(f"{a}:\n{outs[a].strip()}")
        parts.append(_HE_ASKS[agent])
        return "\n\n".join(parts)

    def record(self, step: int, outputs: dict[str, str], timeout_s: float = 10.0) -> None:
        self.outputs.append(dict(outputs))
        if self.task == "gsm8k":
            self.executions.append({a: printed_number(run_python(code_block(t), timeout_s).stdout)
                                    for a, t in outputs.items()})
        else:
            self.executions.append({})


def gsm8k_flow(item: int, question: str, rounds: int = 2) -> Flow:
    return Flow("gsm8k", item, question, [list(GSM8K_DEBATERS)] * rounds, GSM8K_DEBATERS)


def humaneval_flow(item: int, prompt: str) -> Flow:
    return Flow("humaneval", item, prompt, [["Coder"], ["Reviewer"], ["Fixer"]], HUMANEVAL_ROLES)


def gsm8k_vote(flow: Flow) -> str | None:
    """The majority of the last round's printed numbers (ties: the earliest agent's)."""
    last = [flow.executions[-1][a] for a in flow.steps[-1]]
    counts = Counter(n for n in last if n is not None)
    if not counts:
        return None
    best = max(counts.values())
    return next(n for n in last if n is not None and counts[n] == best)


def humaneval_code(problem: dict, reply: str) -> str:
    """The reply's code as a program defines it: after the problem's prompt when the code does
    not define the entry point itself, else after the prompt's imports."""
    code = code_block(reply)
    if not re.search(rf"^\s*def\s+{re.escape(problem['entry_point'])}\s*\(", code, re.M):
        code = problem["prompt"] + code
    elif "import" in problem["prompt"]:  # the prompt's imports (typing, math) stay available
        imports = [ln for ln in problem["prompt"].splitlines()
                   if ln.startswith(("import ", "from "))]
        code = "\n".join(imports) + "\n" + code
    return code


def humaneval_program(problem: dict, reply: str) -> str:
    """The program pass@1 runs: the reply's code (:func:`humaneval_code`), the tests, and the
    call of ``check``."""
    code = humaneval_code(problem, reply)
    return f"{code}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


_EXAMPLES_RUNNER = """
import ast as _ast, doctest as _doctest


class _Checker(_doctest.OutputChecker):  # equal values pass whatever their quotes or spacing
    def check_output(self, want, got, flags):
        if super().check_output(want, got, flags):
            return True
        try:
            return _ast.literal_eval(want.strip()) == _ast.literal_eval(got.strip())
        except Exception:
            return False


try:
    _test = _doctest.DocTestParser().get_doctest({docstring!r}, globals(), "examples", None, 0)
except ValueError:  # examples doctest cannot read (inconsistent indentation): none runnable
    _test = _doctest.DocTest([], globals(), "examples", None, 0, None)
for _example in _test.examples:  # `f(x) == y` with nothing after it: the check must be True
    if not _example.want and "==" in _example.source:
        _example.want = "True\\n"
_runner = _doctest.DocTestRunner(checker=_Checker(), optionflags=_doctest.ELLIPSIS |
                                 _doctest.NORMALIZE_WHITESPACE)
_report = []  # the runner captures stdout while it runs: print the report after
_runner.run(_test, out=_report.append)
print(f"EXAMPLES {{_runner.failures}} {{_runner.tries}}")  # first: the output may be cut
print("".join(_report), end="")
"""
EXAMPLES_REPORT_CHARS = 600
_ALL_PASS = "All {} examples of the specification pass."
_NONE_GIVEN = "The specification gives no runnable example; the code runs without error."


def specification_docstring(problem: dict) -> str:
    """The docstring of the problem's entry point (where its examples are), else ``""``."""
    try:
        tree = ast.parse(problem["prompt"])
    except SyntaxError:
        return ""
    return next((ast.get_docstring(node) or "" for node in ast.walk(tree)
                 if isinstance(node, ast.FunctionDef) and node.name == problem["entry_point"]),
                "")


def humaneval_examples(problem: dict, reply: str, timeout_s: float = 10.0) -> str:
    """What running the specification's own examples (the ``>>>`` lines of its docstring, not
    the hidden tests that grade it) on the reply's code shows, in a few lines for a reviewer:
    that all pass, which fail (expected and got, at most ``EXAMPLES_REPORT_CHARS`` characters),
    that the code does not run, or that the specification gives no runnable example."""
    result = run_python(humaneval_code(problem, reply) + "\n" +
                        _EXAMPLES_RUNNER.format(docstring=specification_docstring(problem)),
                        timeout_s)
    if result.timed_out:
        return f"Running it timed out after {timeout_s:g} s."
    m = re.search(r"^EXAMPLES (\d+) (\d+)\n", result.stdout, re.M)
    if not result.ok or m is None:
        err = result.stderr.strip().splitlines()
        return "Running it failed: " + (err[-1] if err else f"exit status {result.returncode}")
    failed, tried = int(m.group(1)), int(m.group(2))
    if tried == 0:
        return _NONE_GIVEN
    if failed == 0:
        return _ALL_PASS.format(tried)
    report = "\n".join(ln for ln in result.stdout[m.end():].splitlines()
                       if not ln.startswith(("File ", "*****")))
    return (f"{failed} of {tried} examples of the specification fail:\n" +
            report[:EXAMPLES_REPORT_CHARS].rstrip())


def examples_fail(report: str) -> bool:
    """Whether a :func:`humaneval_examples` report says the code failed its examples (or did
    not run): anything but all passing or none given."""
    return not (report == _NONE_GIVEN or re.fullmatch(_ALL_PASS.format(r"\d+"), report))


def humaneval_passes(problem: dict, reply: str, timeout_s: float = 10.0) -> bool:
    return run_python(humaneval_program(problem, reply), timeout_s).ok

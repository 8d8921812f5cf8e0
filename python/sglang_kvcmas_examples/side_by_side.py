"""The same multi-agent workflow on SGLang's radix cache and on sglang-kvcmas, side by side.

Boots the same server binary twice, one at a time so they never compete for cores: first with
SGLang's own tree cache (``--kvcmas-stock-cache``, the baseline a user would otherwise run), then
with cross-agent sharing on (``--kvcmas-share-context``). Against each it runs one SGLang
frontend program: by default the review panel of :mod:`sglang_kvcmas_examples.panel` (16 agents
with their own system prompts over one document, a round's agents at once: where sharing pays);
``--workflow debate``: the 3-agent GSM8K debate of :mod:`sglang_kvcmas_examples.debate` (the
agents of a round at the same time, ``--sequential`` one after another; small enough that an
idle sharing server serves it exactly, as radix does); ``--workflow fanout``: planner, workers,
aggregator. It
then prints one row per turn and a summary::

    turn agent | radix: prompt cached prefill ttft | kvcmas: prompt exact fact repos recomp ttft | same
    ...
    SUMMARY prefill_tokens radix=.. kvcmas=.. (saved ..%) ttft_ratio=..x kv_held radix=..
            kvcmas=.. same_answers=k/n
    WORKFLOW side-by-side-.. requests=.. prompt=.. exact=.. factored=.. repositioned=..
            recomputed=.. completion=.. computed=.. kv_written_mib=.. forecast_total=..

The ``WORKFLOW`` line is the kvcmas server's own ledger of the run (its frontend backend,
:class:`sglang_kvcmas.frontend.KvcmasEndpoint`, names the run's workflow on every request):
``GET /kvcmas/workflows/{id}``.

``exact``: prompt tokens read from KV computed in the agent's own context; ``fact``: read from
another agent's KV through the agent's factored leaves (re-positioned, its deviation added);
``repos``: read from another agent's KV re-positioned only; ``recomp``: prefilled.
``kv held``: pool slots the server holds after the workflow (in use + cached), from its
``/metrics``.

    python -m sglang_kvcmas_examples.side_by_side [--rounds 3] [--max-new-tokens 64]
    python -m sglang_kvcmas_examples.side_by_side --workflow panel [--agents 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from sglang_kvcmas_examples.debate import CHAT_TEMPLATE, DebateRun, Turn, run_debate
from sglang_kvcmas.frontend import KvcmasEndpoint

ARMS = (("radix", ["--kvcmas-stock-cache"]), ("kvcmas", ["--kvcmas-share-context"]))
"""(name, launcher flags): SGLang's own tree cache, then ours with sharing on."""


def say(text: str) -> None:
    print(f"[side-by-side] {text}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class ArmResult:
    """One arm's run: its turns, the KV pool slots it held afterwards, its wall time, and the
    server's ledger of the run's workflow (kvcmas arm)."""

    arm: str
    turns: list[Turn]
    kv_held: int | None
    wall_s: float
    ledger: dict | None = None


def workflow_ledger(url: str, workflow: str) -> dict | None:
    """The server's ledger of ``workflow`` (``GET /kvcmas/workflows/{workflow}``), or None."""
    try:
        with urllib.request.urlopen(f"{url}/kvcmas/workflows/{workflow}", timeout=10) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return None


def workflow_line(ledger: dict) -> str:
    """One line of a workflow's ledger: its token counts, KV bytes written, forecast."""
    forecast = (ledger.get("forecast") or {}).get("total")
    return (f"WORKFLOW {ledger['workflow']} requests={ledger['requests']} "
            f"prompt={ledger['prompt_tokens']} exact={ledger['reused_exact']} "
            f"factored={ledger['reused_factored']} "
            f"repositioned={ledger['reused_repositioned']} recomputed={ledger['recomputed']} "
            f"completion={ledger['completion_tokens']} computed={ledger['computed']} "
            f"kv_written_mib={ledger.get('kv_bytes_written', 0) / 2**20:.1f} "
            f"forecast_total={forecast}")


def kv_held(url: str) -> int | None:
    """Pool slots the server holds (requests' KV + its tree cache), from ``/metrics``."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return None
    total, seen = 0.0, 0
    for line in text.splitlines():
        for name in ("sglang:kv_used_tokens", "sglang:kv_evictable_tokens"):
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
                seen += 1
    return int(total) if seen else None


def run_arm(arm: str, flags: list[str], args: argparse.Namespace, log_dir: Path) -> ArmResult:
    import sglang as sgl

    from sglang_kvcmas_examples.datasets import gsm8k
    from sglang_kvcmas.server.process import ServerProcess

    item = gsm8k()[args.question_index]
    log = log_dir / f"{arm}.log"
    server = ServerProcess(
        args=[*flags, *args.server_args], log_path=log, boot_timeout_s=args.boot_timeout,
        on_wait=lambda s, line: say(f"{arm}: waiting for the server ({s:.0f} s): {line}"))
    say(f"{arm}: starting the server ({' '.join(flags)}; log {log})")
    t0 = time.perf_counter()
    workflow = f"side-by-side-{uuid.uuid4().hex[:8]}" if arm == "kvcmas" else None
    with server:
        say(f"{arm}: healthy after {time.perf_counter() - t0:.0f} s; running the "
            f"{args.workflow}")
        backend = (KvcmasEndpoint(server.url, chat_template_name=CHAT_TEMPLATE,
                                  workflow=workflow) if workflow else
                   sgl.RuntimeEndpoint(server.url, chat_template_name=CHAT_TEMPLATE))
        start = time.perf_counter()

        def progress(turn: Turn) -> None:
            say(f"{arm}: round {turn.round} {turn.agent}: {turn.prompt_tokens} prompt tokens, "
                f"first token after {turn.ttft_client_s:.2f} s")

        run = run_workflow(args, backend, item, progress)
        wall = time.perf_counter() - start
        held = kv_held(server.url)
        ledger = workflow_ledger(server.url, workflow) if workflow else None
    return ArmResult(arm, run.turns, held, wall, ledger)


def run_workflow(args: argparse.Namespace, backend, item, progress):
    """The ``--workflow`` program run against ``backend``: its run (``.turns``)."""
    if args.workflow == "panel":
        from sglang_kvcmas_examples.panel import document, run_panel

        return run_panel(backend, document(args.doc_chars), agents=args.agents,
                         answer_tokens=args.max_new_tokens, on_turn=progress)
    if args.workflow == "fanout":
        from sglang_kvcmas_examples.fanout import run_fanout

        return run_fanout(backend, item.question, item.final, workers=args.agents,
                          answer_tokens=args.max_new_tokens, on_turn=progress)
    run: DebateRun = run_debate(backend, item.question, item.final, rounds=args.rounds,
                                max_new_tokens=args.max_new_tokens, on_turn=progress,
                                parallel=not args.sequential)
    return run


def prefilled(turn: Turn) -> int:
    """Prompt tokens the server computed for the turn."""
    if turn.reuse is not None:
        return int(turn.reuse["recomputed"])
    return turn.prompt_tokens - turn.cached_tokens


def table(radix: ArmResult, ours: ArmResult) -> list[str]:
    """One row per turn. Once an answer differs, later prompts differ too (each arm's own
    transcript), so each arm shows its own prompt length."""
    lines = [
        "                 |      SGLang radix cache       |"
        "                 sglang-kvcmas                  |",
        "turn agent       | prompt cached prefill  ttft s |"
        " prompt exact  fact repos recomp  ttft s | same answer",
    ]
    for i, (a, b) in enumerate(zip(radix.turns, ours.turns), 1):
        rec = b.reuse or {}
        lines.append(
            f"{i:>4} {a.agent:<12}| {a.prompt_tokens:>6} {a.cached_tokens:>6} "
            f"{prefilled(a):>7} {a.ttft_client_s:>7.2f} | {b.prompt_tokens:>6} "
            f"{rec.get('reused_exact', 0):>5} {rec.get('reused_factored', 0):>5} "
            f"{rec.get('reused_repositioned', 0):>5} {prefilled(b):>6} {b.ttft_client_s:>7.2f} | "
            f"{'yes' if a.answer == b.answer else 'no'}")
    return lines


def summary(radix: ArmResult, ours: ArmResult) -> str:
    pa = sum(prefilled(t) for t in radix.turns)
    pb = sum(prefilled(t) for t in ours.turns)
    # The first round has nothing to share in either arm.
    ta = statistics.median(t.ttft_client_s for t in radix.turns if t.round > 1)
    tb = statistics.median(t.ttft_client_s for t in ours.turns if t.round > 1)
    same = sum(a.answer == b.answer for a, b in zip(radix.turns, ours.turns))
    kv = (f"kv_held radix={radix.kv_held} kvcmas={ours.kv_held}"
          + (f" ({ours.kv_held / radix.kv_held:.2f}x)" if radix.kv_held and ours.kv_held else ""))
    return (f"SUMMARY prefill_tokens radix={pa} kvcmas={pb} (saved {1 - pb / max(pa, 1):.0%}) "
            f"median_ttft_after_round_1 radix={ta:.2f}s kvcmas={tb:.2f}s "
            f"({ta / max(tb, 1e-9):.2f}x) {kv} workflow_s radix={radix.wall_s:.1f} "
            f"kvcmas={ours.wall_s:.1f} same_answers={same}/{len(radix.turns)}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--question-index", type=int, default=0, help="GSM8K test item (0..1318)")
    p.add_argument("--rounds", type=int, default=3, choices=(1, 2, 3, 4))
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--sequential", action="store_true",
                   help="debate: agents answer one after another, each over every answer so far")
    p.add_argument("--workflow", choices=("debate", "panel", "fanout"), default="panel",
                   help="the program run: the review panel of 16 agents over one document "
                        "(examples/panel.py, where sharing pays), the 3-agent debate (on an "
                        "idle server sharing serves it exactly, as radix) or planner -> "
                        "workers -> aggregator (examples/fanout.py)")
    p.add_argument("--agents", type=int, default=None,
                   help="panel: panelists (2..16, default 16); fanout: most workers (1..8, "
                        "default 8)")
    p.add_argument("--doc-chars", type=int, default=4000, help="panel: document characters")
    p.add_argument("--boot-timeout", type=float, default=400.0)
    p.add_argument("--server-args", default="", help="extra flags for both servers, e.g. "
                   "'--model-path /path/to/hf-folder'")
    p.add_argument("--json", type=Path, help="also write both arms' turns here")
    args = p.parse_args(argv)
    args.server_args = args.server_args.split()
    if args.agents is None:
        args.agents = 16 if args.workflow == "panel" else 8
    limits = {"panel": (2, 16), "fanout": (1, 8), "debate": (1, 1 << 30)}[args.workflow]
    if not limits[0] <= args.agents <= limits[1]:
        p.error(f"--agents for --workflow {args.workflow}: {limits[0]}..{limits[1]}")
    log_dir = Path(tempfile.mkdtemp(prefix="kvcmas-side-by-side-"))
    results = {arm: run_arm(arm, flags, args, log_dir) for arm, flags in ARMS}
    radix, ours = results["radix"], results["kvcmas"]
    print("\n".join(table(radix, ours)))
    print(summary(radix, ours), flush=True)
    if ours.ledger:
        print(workflow_line(ours.ledger), flush=True)
    if args.json:
        args.json.write_text(json.dumps({a: [asdict(t) for t in r.turns]
                                         for a, r in results.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

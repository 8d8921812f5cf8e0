"""Host work of sharing at scale, without the model: admissions at a 32k-token transcript and
the turn-order hook with 16 waiting agents.

The simulation is ``sglang_kvcmas_bench.host_sim``: the tree cache and the turn-order hook
driven as SGLang's scheduler drives them over a simulated KV pool, ``--agents`` agents taking
turns over a transcript that grows by ``--segment`` tokens a round.

    python benchmark/serving/host_path.py                       # 32k transcript, 16 agents
    python benchmark/serving/host_path.py --transcript 8192 --agents 4
    py-spy record -f raw -o stacks.txt -- python benchmark/serving/host_path.py
    python benchmark/serving/host_path.py --summarize stacks.txt   # where admission time goes

Prints one line per round and ends with
``HOST host_ms_per_admission_32k=<x> hook_ms_per_iter_16agents=<x>`` (medians over the last
round's readers and over ``--hook-iters`` hook calls); ``--out`` writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from sglang_kvcmas_bench.host_sim import run
from sglang_kvcmas_bench.results import record


def summarize(raw: Path, top: int = 20) -> str:
    """Where a py-spy ``--format raw`` profile of this benchmark spends its time: for the
    admissions and for the hook calls, the functions with the largest inclusive and self shares
    (file names shortened to the package path)."""
    import collections

    def short(frame: str) -> str:
        name, _, where = frame.partition(" (")
        path = where.rsplit(":", 1)[0]
        for mark in ("sglang_kvcmas/", "sglang/srt/", "site-packages/"):
            if mark in path:
                path = path.split(mark, 1)[1]
                break
        return f"{name} ({path})"

    parts = {"admission": "HostSim.admit", "turn-order hook": "hook_ms"}
    inclusive = {k: collections.Counter() for k in parts}
    own = {k: collections.Counter() for k in parts}
    totals = dict.fromkeys(parts, 0)
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        frames = stack.split(";")
        for part, marker in parts.items():
            at = next((i for i, f in enumerate(frames) if f.startswith(marker)), None)
            if at is None:
                continue
            below = [short(f) for f in frames[at + 1 :]]
            totals[part] += int(n)
            for name in set(below):
                inclusive[part][name] += int(n)
            if below:
                own[part][below[-1]] += int(n)
    lines = [f"# {raw.name}: py-spy samples under each part (inclusive / self share)"]
    for part in parts:
        total = max(1, totals[part])
        lines.append(f"## {part}: {totals[part]} samples")
        lines += [f"{c / total:7.1%} incl  {k}" for k, c in inclusive[part].most_common(top)]
        lines += [f"{c / total:7.1%} self  {k}" for k, c in own[part].most_common(top // 2)]
    return "\n".join(lines) + "\n"


def main_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmark's arguments (defaults: 16 agents, 32k transcript)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--agents", type=int, default=16)
    p.add_argument("--transcript", type=int, default=32768, help="shared transcript tokens")
    p.add_argument("--segment", type=int, default=2048, help="tokens added per round")
    p.add_argument("--head", type=int, default=120, help="system-prompt tokens per agent")
    p.add_argument("--hook-iters", type=int, default=50)
    p.add_argument("--out", type=Path, default=None, help="JSON path (default: print only)")
    p.add_argument("--summarize", type=Path, default=None, metavar="RAW",
                   help="print where a py-spy raw profile of this benchmark spends its time")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = main_args(argv)
    if args.summarize:
        print(summarize(args.summarize), end="")
        return 0
    t0 = time.monotonic()
    result = run(args.agents, args.transcript, args.segment, args.head, args.hook_iters)
    result["wall_s"] = round(time.monotonic() - t0, 1)
    k = args.transcript // 1024
    line = (f"HOST host_ms_per_admission_{k}k={result['host_ms_per_admission']:.2f} "
            f"hook_ms_per_iter_{result['hook_waiting'] + 1}agents="
            f"{result['hook_ms_per_iter']:.3f} hook_held={result['hook_held']}")
    if args.out:
        record(args.out, json.dumps(result, indent=1) + "\n",
               what=f"the host path alone ({args.agents} agents, {args.transcript}-token "
                    f"transcript): `{line}`")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""LoRA head-to-head: stock SGLang LoRA serving (radix cache) vs our modes for LoRA agents.

Agents differ by LoRA adapter (default: the package's planner / solver / critic role adapters of
the model served, ``sglang_kvcmas.adapters``: the embedded model's, and Qwen2.5-Coder-0.5B's):
every agent sees the same ChatML transcript (one system message, the question, the agents' messages
as assistant turns), so the adapter alone decides what it writes. A workflow is ``--rounds`` rounds
over one GSM8K question: by default a ``panel`` (every round all adapters answer the transcript
together, their messages appended in order), or with ``--shape chain`` planner -> solver -> critic
one at a time; with ``--shots K`` each question comes after K worked GSM8K examples of its
workflow's own (a task context every agent reads, as retrieved examples or a document would be).
``--flows`` workflows run concurrently, after one short request per adapter (its
head cached, as a deployment's earlier traffic leaves it); every request names its workflow. Same
server binary, one server at a time, the same KV pool for every arm:

    stock           --kvcmas-stock-cache: SGLang's LoRA serving; its radix cache keys every
                    prefix by adapter, so each adapter prefills the transcript itself
    borrow          --kvcmas-share-context --kvcmas-lora-share borrow (the headline's mode): an
                    adapter reads the transcript another adapter computed (re-positioned;
                    boundary tokens and the last 32 tokens recomputed with its own adapter, kept
                    as its leaves)
    borrow_*        the same with one flag changed: ``exact`` (exact leaves); or with
                    an adapter reader's picks (served: the first 8 tokens of every span and
                    message, the last 32, none by head mass) set by every request of the arm
                    (:data:`ARM_FIELDS`): ``noboundary`` / ``boundary16`` (no span's first
                    tokens recomputed, the tail only / 16 of them), ``noboundary_tail48`` (no
                    boundary, a 48-token tail), ``notail`` / ``tail16`` / ``tail64``,
                    ``mass10`` / ``mass25`` (a tenth / a quarter of the borrowed tokens by
                    head mass), ``naive`` (no boundary, no tail: nothing recomputed but what
                    the reader's suffix needs, the ceiling of cross-adapter reuse's TTFT)

The modes ``catchup`` and ``rebase`` this benchmark once compared are no longer served: their
figures are in ``docs/results.md`` ("Serving: LoRA agents").

By default every arm but stock replays the stock arm's transcripts: each turn's prompt is built
from the stock turns' messages and it decodes as many tokens as the stock turn did
(``ignore_eos``), so every arm serves the same prompts and the same decode work
(``--own-transcripts``: each arm's workflows grow by its own answers, whose lengths then differ
between arms and move TTFT and makespan with them). Every request names its head and shared
transcript (``kvcmas_head_len`` / ``kvcmas_shared_end``, the chat template's split), as SGLang's
chat route does under the plugin.

Per arm: TTFT over non-owner turns (every turn after a workflow's first round: each adapter has
spoken, so any mode may serve it from another adapter's work; the same turns in every arm, and
the ``borrow`` arm reads another adapter's KV only in some of them) and over the first round's
turns (every agent's first read of the task), workflow makespan, token
throughput, peak KV (pool slots held x bytes per token, + factored leaf bytes; the
LoRA weight buffers are the same in every arm and not counted), tokens prefilled (foreground +
background), and the share of workflows whose last solver answer is the stock arm's (replayed:
the same transcript, its own last answer). Fidelity, per arm, on its own server after its run:
the stock arm's turns are replayed in workflow order (each turn's prompt + the stock
continuation, teacher-forced, so each reads what it would read as served) and compared per
position with an exact prefill of the same request (fresh ``cache_salt``: nothing shared or
cached): top-1 agreement and KL on the exact top-20, over the replayed turns that read another
adapter's KV; for the cross-adapter arms the replay
is repeated after a cache flush with naive reuse (nothing recomputed) for
``kl_recovered = 1 - KL(mode) / KL(naive)``.

    python benchmark/serving/lora_head_to_head.py --quick     # 3 flows x 3 rounds, 2 arms, ~6 min
    python benchmark/serving/lora_head_to_head.py [--flows 6 --rounds 3 --max-new-tokens 96]
        [--shape panel|chain] [--shots K] [--arms stock,borrow,borrow_tail64,...]
        [--own-transcripts] [--profile]
        [--adapters name=path,...] [--model-path NAME]

``KVCMAS_BENCH_SERVER_ARGS`` (e.g. ``--device cuda --dtype bfloat16``) is appended to every arm's
server flags, as for the other serving benchmarks.

Ends with ``HEADLINE mode=<default> ttft_speedup_vs_stock=... kv_ratio_vs_stock=... tf_top1=...
kl_recovered=... bg_prefill_tokens_ratio=...`` (``kv_ratio`` = stock peak KV / ours;
``bg_prefill_tokens_ratio`` = tokens the mode prefills, foreground and background (the heads
an agent's first request prefills on its own), / tokens stock prefills). Writes
``lora_head_to_head[_<shape>][_quick][_shots<K>][_<model>]`` ``.txt`` (the table and the
headline), ``.jsonl`` (one record per arm) and ``.png`` in ``--out`` (default ``results/``, each
with its row in the folder's index); each arm's turns and the servers' logs go to a folder of
that name.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import sys
import threading
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from sglang_kvcmas.envs import KVCMAS_BENCH_SERVER_ARGS
from sglang_kvcmas.server.process import ServerProcess, free_port
from sglang_kvcmas_bench import provenance
from sglang_kvcmas_bench.figures import pct
from sglang_kvcmas_bench.forced_reads import forced, kl_on_support
from sglang_kvcmas_bench.kv_sampler import KvSampler
from sglang_kvcmas_bench.model_arg import add_model_arg, model_from_args
from sglang_kvcmas_bench.results import record
from sglang_kvcmas_bench.reuse_records import of_meta
from sglang_kvcmas_bench.scheduler_profile import SchedulerProfile
from sglang_kvcmas_bench.scheduler_profile import report as profile_report
from sglang_kvcmas_bench.server_arms import COMMON_FLAGS, shared_tree_stats
from sglang_kvcmas_bench.server_calls import flush, stream_generate
from sglang_kvcmas_bench.workload_runs import replay_steps

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_MODE = "borrow"
"""The mode the headline reports: the one served mode that shares across adapters."""
SHARE = ["--kvcmas-share-context", "--kvcmas-lora-share", "borrow"]
ARMS: dict[str, list[str]] = {
    "stock": ["--kvcmas-stock-cache"],
    "borrow": SHARE,
    "borrow_exact": [*SHARE, "--kvcmas-leaf-mode", "exact"],
}
_PICKS = {"borrow_noboundary": {"kvcmas_recompute_boundary": 0},
          "borrow_boundary16": {"kvcmas_recompute_boundary": 16},
          "borrow_noboundary_tail48": {"kvcmas_recompute_boundary": 0,
                                       "kvcmas_recompute_tail": 48},
          "borrow_notail": {"kvcmas_recompute_tail": 0},
          "borrow_tail16": {"kvcmas_recompute_tail": 16},
          "borrow_tail64": {"kvcmas_recompute_tail": 64},
          "borrow_mass10": {"kvcmas_recompute_mass_fraction": 0.1},
          "borrow_mass25": {"kvcmas_recompute_mass_fraction": 0.25},
          "borrow_naive": {"kvcmas_recompute_boundary": 0, "kvcmas_recompute_tail": 0}}
ARM_FIELDS: dict[str, dict] = {arm: {**picks, "kvcmas_read_leaves": True}
                               for arm, picks in _PICKS.items()}
"""Arms served as ``borrow`` whose every request (turn and replay) sets an adapter reader's picks
in ``custom_params``, each pick it does not set the served one, and reads its leaves as a reader
with the served picks does. Unlike one with the served picks, such a request borrows even fewer
tokens than ``policy.recompute.MIN_BORROWED``."""
ARMS.update(dict.fromkeys(ARM_FIELDS, SHARE))
QUICK_ARMS = ("stock", DEFAULT_MODE)
"""What ``--quick`` runs unless ``--arms`` says otherwise."""
CROSS_ADAPTER = tuple(arm for arm in ARMS if arm.startswith("borrow"))
"""Arms whose adapters read KV another adapter computed (stock's caches are exact)."""
NAIVE = {"kvcmas_recompute_boundary": 0, "kvcmas_recompute_mass_fraction": 0.0,
         "kvcmas_recompute_tail": 0}
"""Per-request knobs of naive cross-adapter reuse: every borrowed token read as computed."""


def default_adapters(model: str | None = None) -> dict[str, Path]:
    """The package's role adapters of ``model`` (None: the embedded model's)."""
    from sglang_kvcmas.adapters import ROLES, role_adapter_dir

    out = {role: role_adapter_dir("attn", role, model) for role in ROLES}
    if not all(p.is_dir() for p in out.values()):
        raise SystemExit(f"no role adapters ship for {model}: train them "
                         f"(scripts/train_role_adapters.py --model-path {model} --out DIR) and "
                         "pass --adapters planner=DIR/attn/planner,...")
    return out


def parse_adapters(text: str | None, model: str | None = None) -> dict[str, Path]:
    """``name=path,...`` (PEFT folders) -> {name: path}; None: the package's role adapters of
    ``model`` (None: the embedded model's)."""
    if not text:
        return default_adapters(model)
    out = {}
    for part in text.split(","):
        name, sep, path = part.partition("=")
        if not sep or not Path(path).is_dir():
            raise SystemExit(f"--adapters: expected name=folder, got {part!r}")
        out[name] = Path(path)
    return out


@dataclass
class LoraFlow:
    """One workflow: its question, its steps (groups of agents that answer together over the
    same transcript), and the messages so far."""

    wid: int
    question: str
    steps: list[list[str]]
    messages: list[str] = field(default_factory=list)

    def prompt(self) -> str:
        from sglang_kvcmas.adapters.role_data import SYSTEM, Message, chat_text

        msgs = [Message("system", SYSTEM), Message("user", self.question)]
        msgs += [Message("assistant", m.strip()) for m in self.messages]
        return chat_text(msgs, open_turn=True)


SHAPES = ("panel", "chain")


def flow_steps(shape: str, agents: list[str], rounds: int) -> list[list[str]]:
    """``panel``: every round, all agents answer the transcript together (their messages appended
    in agent order); ``chain``: one agent per step, in order, ``rounds`` times."""
    if shape == "panel":
        return [list(agents)] * rounds
    return [[a] for a in agents] * rounds


SHOTS_FROM = 500
"""GSM8K item where the worked examples of ``--shots`` start (past every flow's question)."""


def build_flows(n: int, steps: list[list[str]], shots: int = 0) -> list[LoraFlow]:
    """``n`` workflows on GSM8K questions 200, 201, ...; with ``shots``, each question comes
    after worked examples of its own (``shots`` GSM8K solutions, different for every workflow, as
    a retriever would pick them): a task context every agent of the workflow reads, which stock
    serving prefills once per adapter."""
    from sglang_kvcmas_examples.datasets import gsm8k

    items = gsm8k()

    def task(i: int) -> str:
        first = SHOTS_FROM + i * shots
        examples = [f"Worked example {j + 1}.\nQuestion: {items[first + j].question}\n"
                    f"Solution: {re.sub(r'<<[^>]*>>', '', items[first + j].answer)}\n\n"
                    for j in range(shots)]  # without GSM8K's calculator annotations
        return "".join(examples) + (f"Question: {items[200 + i].question}" if shots
                                    else items[200 + i].question)

    return [LoraFlow(i, task(i), steps) for i in range(n)]


def warm_heads(url: str, adapters: list[str], tok) -> None:
    """One short request per adapter, as a deployment's earlier traffic would have sent: every
    adapter's head (the system turn) is cached before a workflow starts, in every arm (a
    reader can only borrow after its own head)."""
    from sglang_kvcmas.adapters.role_data import SYSTEM, Message, chat_text

    text = chat_text([Message("system", SYSTEM), Message("user", "What is 2 + 2?")],
                     open_turn=True)
    for name in adapters:
        stream_generate(url, tok.encode(text, add_special_tokens=False), 1, {"lora_path": name})


def run_flows(url: str, flows: list[LoraFlow], tok, max_new: int,
              script: dict[tuple, dict] | None = None,
              custom: dict | None = None) -> tuple[list[dict], float]:
    """Every workflow concurrently, its steps in order (a step's agents together); one record
    per agent turn, and the makespan. With ``script`` (the stock arm's turns by :func:`key`),
    every turn decodes exactly as many tokens as the stock turn did (``ignore_eos``) and the
    transcript grows by the stock turns' messages, not this arm's: every arm serves the same
    prompts and the same decode work. ``custom``: fields every request adds to its
    ``custom_params`` (:data:`ARM_FIELDS`)."""
    turns: list[dict] = []
    lock = threading.Lock()
    split = template_split(tok)

    def turn(flow: LoraFlow, step: int, agent: str, ids: list[int]) -> dict:
        fields = request_fields(flow.wid, agent, max_new, {**split(ids), **(custom or {})})
        ref = script.get((flow.wid, step, agent)) if script is not None else None
        n = max_new
        if ref is not None:
            n = max(1, len(ref["output_ids"] or []))
            fields["sampling_params"].update(max_new_tokens=n, ignore_eos=True)
        return stream_generate(url, ids, n, fields)

    def one(flow: LoraFlow) -> float:
        t0 = time.perf_counter()
        for step, agents in enumerate(flow.steps):
            ids = tok.encode(flow.prompt(), add_special_tokens=False)
            with ThreadPoolExecutor(len(agents)) as pool:
                outs = list(pool.map(lambda a: turn(flow, step, a, ids), agents))
            with lock:
                turns.extend({"wid": flow.wid, "step": step, "agent": a, "prompt_ids": ids, **o}
                             for a, o in zip(agents, outs))
            if script is None:
                flow.messages.extend(o["text"] for o in outs)
            else:
                flow.messages.extend(script[(flow.wid, step, a)]["text"] for a in agents)
        return time.perf_counter() - t0

    with ThreadPoolExecutor(len(flows)) as pool:
        spans = list(pool.map(one, flows))
    return turns, max(spans)


def workflow_id(wid: int) -> dict:
    """A turn's workflow id (``custom_params``): the server counts each workflow's turns."""
    return {"kvcmas_workflow": f"lora-{wid}"}


def template_split(tok):
    """``ids`` -> the ``custom_params`` naming its head and shared transcript, as SGLang's chat
    route sets them under the plugin (the chat template's split; none if it finds none, or
    finds no template)."""
    from sglang_kvcmas.integration.chat_template_markers import markers_for_tokenizer
    from sglang_kvcmas.tree.agent_split import detect_template_split

    markers = markers_for_tokenizer(tok)

    def split(ids: list[int]) -> dict:
        s = detect_template_split(ids, markers) if markers is not None else None
        return {} if s is None else {"kvcmas_head_len": s.head_len,
                                     "kvcmas_shared_end": s.shared_end}

    return split


def request_fields(wid: int, adapter: str, max_new: int, named: dict | None = None) -> dict:
    """A turn's request fields beyond the prompt: its adapter, greedy sampling, its workflow
    (and ``named``: its head and shared transcript)."""
    return {"lora_path": adapter, "sampling_params": {
        "temperature": 0, "max_new_tokens": max_new,
        "custom_params": {**workflow_id(wid), **(named or {})}}}


def key(t: dict) -> tuple:
    return (t["wid"], t["step"], t["agent"])


def prefilled(t: dict) -> int:
    """Tokens this turn prefilled: our record's count, else prompt minus cached."""
    rec = of_meta(t["meta"])
    if rec:
        return rec["recomputed"]
    return t["meta"]["prompt_tokens"] - t["meta"].get("cached_tokens", 0)


def last_answer(turns: list[dict], wid: int) -> str | None:
    """The workflow's last solver answer (``ANSWER: <number>``, else its last number)."""
    from sglang_kvcmas_examples.datasets import last_number

    mine = [t for t in turns if t["wid"] == wid]
    solver = [t for t in mine if t["agent"] == "solver"] or mine  # other adapters: the last turn
    if not solver:
        return None
    return last_number(max(solver, key=lambda t: t["step"])["text"])


def replay(url: str, ref_turns: list[dict], custom: dict | None, exact: bool) -> list[dict]:
    """Teacher-force the reference turns in workflow order (workflows concurrently): per turn,
    the top-20 per position as served (``custom``: per-request knobs), and with ``exact`` the
    same request under a fresh ``cache_salt``."""

    def one(t: dict) -> dict:
        cont = list(t["output_ids"] or [])[:32]
        body = {"lora_path": t["agent"]}
        rec = {"wid": t["wid"], "step": t["step"], "agent": t["agent"], "cont": cont,
               "got": forced(url, t["prompt_ids"], cont, body=body,
                             custom={**workflow_id(t["wid"]), **(custom or {})})}
        if exact:
            rec["exact"] = forced(url, t["prompt_ids"], cont, salt=f"x-{uuid.uuid4()}",
                                  body=body, custom={"kvcmas_exact": True})
        return rec

    return replay_steps(ref_turns, lambda t: t["wid"], one)


def fidelity(url: str, ref_turns: list[dict], warm, cross_adapter: bool,
             custom: dict | None = None) -> dict:
    """Top-1 and KL20 against exact prefill over the replayed non-owner turns: those that read
    another adapter's KV (``cross_adapter``; with naive reuse replayed too, for KL recovered),
    else every turn after a workflow's first step (the arm's own reads are exact). ``custom``:
    the arm's per-request fields (:data:`ARM_FIELDS`), sent with every served replay."""
    flush(url)
    warm()
    served = {key(r): r for r in replay(url, ref_turns, custom, exact=True)}
    naive: dict = {}
    if cross_adapter:
        flush(url)
        warm()
        naive = {key(r): r for r in replay(url, ref_turns, NAIVE, exact=False)}
    top1, kl, kl_naive, top1_naive, n_turns = [], [], [], [], 0
    per_turn: dict[str, list] = {}
    for k, r in served.items():
        reads = r["got"]["reuse"].get("borrowed", 0) > 0 if cross_adapter else r["step"] > 0
        if not reads:
            continue  # an owner turn: nothing read from another adapter
        n_turns += 1
        ref, got = r["exact"], r["got"]
        nv = naive[k]["got"] if cross_adapter else None
        first = len(kl)
        first_naive = len(kl_naive)
        for i in range(min(len(ref["tops"]), len(got["tops"]))):
            e, g = ref["tops"][i], got["tops"][i]
            v = nv["tops"][i] if nv is not None and i < len(nv["tops"]) else None
            if not e or not g or (nv is not None and not v):
                continue
            best = max(e, key=e.get)
            top1.append(max(g, key=g.get) == best)
            kl.append(kl_on_support(e, g))
            if v:
                top1_naive.append(max(v, key=v.get) == best)
                kl_naive.append(kl_on_support(e, v))
        if len(kl) > first:
            per_turn[repr(k)] = [statistics.fmean(kl[first:]),
                                 statistics.fmean(kl_naive[first_naive:])
                                 if len(kl_naive) > first_naive else None]
    mean = statistics.fmean
    out: dict = {"turns": n_turns, "positions": len(top1), "per_turn": per_turn}
    if top1:
        out.update(tf_top1=mean(top1), kl20=mean(kl))
    if kl_naive:
        out.update(naive_tf_top1=mean(top1_naive), naive_kl20=mean(kl_naive))
        out["kl_recovered"] = 1 - out["kl20"] / out["naive_kl20"] if out["naive_kl20"] else None
    return out


def metric_total(url: str, names: tuple[str, ...], label: str = "") -> int:
    """The sum of the server's Prometheus samples named ``names`` (with ``label``, e.g.
    ``kind="prefilled"``, where given); 0 where none is exported."""
    total = 0
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in names and label in line:
                total += int(float(line.rsplit(" ", 1)[1]))
    return total


def background_prefilled(url: str) -> int:
    """Tokens the server prefilled on its own: the heads an agent's first request over a long
    transcript prefills first (``kvcmas:head_prefill_tokens``)."""
    return metric_total(url, ("kvcmas:head_prefill_tokens_total",), 'kind="prefilled"')


def factored_bytes(url: str) -> int:
    """Leaf bytes the server holds off the pool (0 for the stock cache): factored leaves (never
    trimmed here: no leaf budget, so the end of the run is their peak)."""
    return int(shared_tree_stats(url).get("factored_bytes", 0))


def summarize(arm: str, turns: list[dict], makespan: float, peak_tokens: int, extra_bytes: int,
              background: int, non_owner: set, kv_bytes_per_token: int) -> dict:
    no = [t["ttft"] for t in turns if key(t) in non_owner]
    first = [t["ttft"] for t in turns if key(t) not in non_owner]
    out_tok = sum(t["meta"].get("completion_tokens", 0) for t in turns)
    in_tok = sum(t["meta"].get("prompt_tokens", 0) for t in turns)
    return {
        "arm": arm, "turns": len(turns), "makespan_s": makespan,
        "ttft_median_s": statistics.median(t["ttft"] for t in turns),
        "nonowner_turns": len(no),
        "nonowner_ttft_mean_s": statistics.fmean(no) if no else None,
        "nonowner_ttft_median_s": statistics.median(no) if no else None,
        "nonowner_ttft_p99_s": pct(no, 0.99) if no else None,
        "first_round_ttft_median_s": statistics.median(first) if first else None,
        "input_tokens": in_tok, "output_tokens": out_tok,
        "prefilled_tokens": sum(prefilled(t) for t in turns),
        "background_prefilled_tokens": background,
        "total_throughput_tok_s": (in_tok + out_tok) / makespan,
        "peak_kv_tokens": peak_tokens,
        "peak_kv_bytes": peak_tokens * kv_bytes_per_token + extra_bytes,
        "factored_bytes": extra_bytes,
    }


def plot(summaries: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [s["arm"] for s in summaries]
    panels = [("nonowner_ttft_median_s", "non-owner TTFT median (s)"),
              ("first_round_ttft_median_s", "round-1 TTFT median (s)"),
              ("makespan_s", "workflow makespan (s)"),
              ("peak_kv_bytes", "peak KV (MiB)")]
    panels = [(k, title) for k, title in panels if any(s.get(k) for s in summaries)]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.5))
    for ax, (k, title) in zip(axes, panels):
        vals = [(s.get(k) or 0) / (2**20 if k == "peak_kv_bytes" else 1) for s in summaries]
        ax.bar(arms, vals, color=["#888"] + ["#3a7"] * (len(arms) - 1))
        ax.set_title(title, fontsize=10)
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle("LoRA agents: stock SGLang LoRA serving vs our modes", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 flows x 3 rounds, 64 tokens")
    ap.add_argument("--flows", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shape", choices=SHAPES, default="panel",
                    help="panel: each round all adapters answer together; chain: one at a time")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--shots", type=int, default=0,
                    help="worked GSM8K examples before each workflow's question, different for "
                         "every workflow (a task context all its agents read; default none)")
    ap.add_argument("--arms", default=None,
                    help=f"comma-separated, stock first (default: {','.join(QUICK_ARMS)} with "
                         "--quick, else every arm)")
    ap.add_argument("--adapters", default=None,
                    help="name=PEFT-folder,... (default: the package's role adapters, spoken in "
                         "the order given)")
    ap.add_argument("--own-transcripts", action="store_true",
                    help="each arm's workflows grow by its own answers (default: every arm "
                         "replays the stock arm's messages and decode lengths, so all serve the "
                         "same prompts and the same decode work)")
    ap.add_argument("--profile", action="store_true",
                    help="sample each arm's scheduler with py-spy during its workflows and write "
                         "lora_head_to_head[...]_profile_<arm>.txt (where the time goes)")
    ap.add_argument("--out", type=Path, default=RESULTS,
                    help="folder of lora_head_to_head[_<shape>][_quick][_shots<K>][_<model>]."
                         "{txt,jsonl,png} (default: results/); servers' logs and each arm's "
                         "turns go to a folder of that name in it")
    add_model_arg(ap)
    args = ap.parse_args()
    if args.quick:
        args.flows, args.rounds, args.max_new_tokens = 3, 3, 64
    model = model_from_args(ap, args)
    stem = "lora_head_to_head" + ("" if args.shape == "panel" else f"_{args.shape}") \
        + ("_quick" if args.quick else "") + (f"_shots{args.shots}" if args.shots else "")
    name = model.named(Path(stem)).name
    out_dir, scratch = args.out, args.out / name
    scratch.mkdir(parents=True, exist_ok=True)
    adapters = parse_adapters(args.adapters, model.name)
    arms = (args.arms or ",".join(QUICK_ARMS if args.quick else ARMS)).split(",")
    if arms[0] != "stock" or any(a not in ARMS for a in arms) or len(arms) < 2:
        raise SystemExit(f"--arms: 'stock' first, then some of {list(ARMS)[1:]}")
    lora_flags = ["--enable-lora", "--lora-paths", *(f"{n}={p}" for n, p in adapters.items())]
    user_flags = shlex.split(KVCMAS_BENCH_SERVER_ARGS.get())  # e.g. --device cuda; last: they win
    tok = model.tokenizer()
    commit = provenance.commit()
    machine = provenance.machine()
    t_start = time.perf_counter()
    runs: dict[str, tuple] = {}
    fid: dict[str, dict] = {}
    for arm in arms:
        server = ServerProcess(
            args=[*ARMS[arm], *COMMON_FLAGS, *model.server_args, *lora_flags, *user_flags],
            log_path=scratch / f"server_{arm}.log", port=free_port(31000, 32000),
            boot_timeout_s=400)
        with server:
            stream_generate(server.url, tok.encode("Warm up."), 4)
            warm_heads(server.url, list(adapters), tok)
            flows = build_flows(args.flows, flow_steps(args.shape, list(adapters), args.rounds),
                                args.shots)
            sampler = KvSampler(server.url)
            sampler.start()
            script = None if arm == "stock" or args.own_transcripts else \
                {key(t): t for t in runs["stock"][0]}
            raw = scratch / f"profile_{arm}.raw"
            spy = SchedulerProfile(server.proc.pid, raw).start() if args.profile else None
            turns, makespan = run_flows(server.url, flows, tok, args.max_new_tokens, script,
                                        ARM_FIELDS.get(arm))
            peak = sampler.stop()
            if spy is not None and spy.stop() is not None:
                record(model.named(out_dir / f"{stem}_profile_{arm}.txt"), profile_report(raw),
                       what=f"py-spy profile of the {arm} scheduler during that run")
            extra = factored_bytes(server.url) if arm != "stock" else 0
            runs[arm] = (turns, makespan, peak, extra, background_prefilled(server.url))
            print(f"[lora_head_to_head] arm {arm}: {len(turns)} turns in {makespan:.0f} s"
                  f" (at {time.perf_counter() - t_start:.0f} s)", file=sys.stderr, flush=True)
            if arm != "stock":
                fid[arm] = fidelity(server.url, runs["stock"][0],
                                    lambda: warm_heads(server.url, list(adapters), tok),
                                    arm in CROSS_ADAPTER, ARM_FIELDS.get(arm))
                shown = {k: v for k, v in fid[arm].items() if k != "per_turn"}
                print(f"[lora_head_to_head] arm {arm}: fidelity {shown} "
                      f"(at {time.perf_counter() - t_start:.0f} s)", file=sys.stderr, flush=True)

    ours_default = DEFAULT_MODE if DEFAULT_MODE in runs else arms[1]
    per_round = 1 if args.shape == "panel" else len(adapters)
    non_owner = {key(t) for t in runs["stock"][0] if t["step"] >= per_round}
    summaries = [summarize(a, *runs[a], non_owner, model.kv_bytes_per_token) for a in arms]
    stock = summaries[0]
    ref_answers = [last_answer(runs["stock"][0], w) for w in range(args.flows)]
    lines = [f"# command: python {' '.join(sys.argv)}",
             f"# lora_head_to_head {model.name} commit {commit} on {machine}",
             f"# {args.flows} {args.shape} flows x {args.rounds} rounds of {', '.join(adapters)}, "
             f"{args.max_new_tokens} new tokens"
             + (f", {args.shots} worked examples before each question" if args.shots else "")
             + ", one server at a time, "
             + ("each arm's own transcripts" if args.own_transcripts else
                "every arm replaying stock's messages and decode lengths"),
             f"{'arm':<16}{'nonowner TTFT med ms':>21}{'round-1 TTFT ms':>16}{'makespan s':>12}"
             f"{'tok/s':>9}"
             f"{'peak KV MiB':>13}{'prefilled':>11}{'same answer':>13}{'tf top1':>9}"
             f"{'KL20':>9}{'KL naive':>10}{'KL rec':>8}"]
    records = []
    for s in summaries:
        arm = s["arm"]
        same = sum(last_answer(runs[arm][0], w) == a for w, a in enumerate(ref_answers))
        s["same_final_answer"] = same / max(1, args.flows)
        f = fid.get(arm, {})
        s["fidelity"] = f
        s.update(speedup_nonowner_ttft=(stock["nonowner_ttft_median_s"]
                                        / s["nonowner_ttft_median_s"])
                 if s["nonowner_ttft_median_s"] else None,
                 speedup_first_round_ttft=(stock["first_round_ttft_median_s"]
                                           / s["first_round_ttft_median_s"])
                 if s["first_round_ttft_median_s"] else None,
                 kv_ratio_vs_stock=stock["peak_kv_bytes"] / max(1, s["peak_kv_bytes"]),
                 prefill_ratio_vs_stock=(s["prefilled_tokens"] + s["background_prefilled_tokens"])
                 / max(1, stock["prefilled_tokens"]))
        fmt = (lambda k, w, p: f"{f[k]:>{w}.{p}f}" if f.get(k) is not None else f"{'-':>{w}}")
        lines.append(
            f"{arm:<16}{(s['nonowner_ttft_median_s'] or 0) * 1e3:>21.1f}"
            f"{(s['first_round_ttft_median_s'] or 0) * 1e3:>16.1f}{s['makespan_s']:>12.1f}"
            f"{s['total_throughput_tok_s']:>9.1f}{s['peak_kv_bytes'] / 2**20:>13.2f}"
            f"{s['prefilled_tokens'] + s['background_prefilled_tokens']:>11}"
            f"{same:>10}/{args.flows:<2}"
            f"{fmt('tf_top1', 9, 3)}{fmt('kl20', 9, 4)}{fmt('naive_kl20', 10, 4)}"
            f"{fmt('kl_recovered', 8, 2)}")
        records.append({"model": model.name, "commit": commit, "machine": machine,
                        "flows": args.flows, "rounds": args.rounds, "shape": args.shape,
                        "shots": args.shots,
                        "max_new_tokens": args.max_new_tokens, "adapters": list(adapters), **s})
    text = "\n".join(lines)
    print(text)
    about = (f"LoRA {args.shape}{' quick' if args.quick else ''}, {args.flows} flows x "
             f"{args.rounds} rounds ({model.name}"
             + (f", {args.shots} worked examples" if args.shots else "") + "), arms "
             + ", ".join(arms) + (", each on its own transcripts" if args.own_transcripts
                                  else ", every arm on stock's transcripts"))
    for arm in arms:  # each arm's turns: the raw data, not a result
        with open(scratch / f"turns_{arm}.jsonl", "w") as fh:
            for t in runs[arm][0]:
                fh.write(json.dumps({k: v for k, v in t.items() if k != "prompt_ids"}) + "\n")
    best = next(s for s in summaries if s["arm"] == ours_default)
    f = dict(best["fidelity"])
    naive = next((s["fidelity"]["naive_kl20"] for s in summaries
                  if s["fidelity"].get("naive_kl20")), None)
    if f.get("kl_recovered") is None and naive and f.get("kl20") is not None:
        f["kl_recovered"] = 1 - f["kl20"] / naive  # against the naive reuse a borrow arm measured

    def num(v, digits: int) -> str:
        return "nan" if v is None else f"{v:.{digits}f}"

    headline = (f"HEADLINE mode={ours_default} "
                f"ttft_speedup_vs_stock={num(best['speedup_nonowner_ttft'], 2)} "
                f"kv_ratio_vs_stock={num(best['kv_ratio_vs_stock'], 2)} "
                f"tf_top1={num(f.get('tf_top1'), 3)} kl_recovered={num(f.get('kl_recovered'), 2)} "
                f"bg_prefill_tokens_ratio={num(best['prefill_ratio_vs_stock'], 2)}")
    record(out_dir / f"{name}.txt", text + "\n" + headline + "\n",
           what=f"{about}: per arm TTFT, makespan, peak KV, prefill, same answer, "
                f"teacher-forced top-1 and KL; `{headline}`")
    record(out_dir / f"{name}.jsonl", "".join(json.dumps(r) + "\n" for r in records),
           what=f"its records, one per arm ({about})")
    record(out_dir / f"{name}.png", lambda p: plot(summaries, p),
           what=f"its plot ({about})")
    print(headline)
    return 0


if __name__ == "__main__":
    sys.exit(main())

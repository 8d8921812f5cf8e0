"""Study: which borrowed tokens should an adapter reader recompute over the centroid's KV?

Under ``rebase`` (a LoRA mode served until 2026-12-06, here rebuilt offline) the adapters'
centroid computes the shared transcript and
every adapter reads it: its own head (system prompt) exact, the centroid's KV elsewhere, and a set
of picked tokens recomputed with its own adapter through every layer (attending to the centroid's
KV where nothing was recomputed). The server's picks are the first 8 tokens of every message and
the last 32 of the prompt (``policy/lora_share.py``); a request can add a share of the rest by
the centroid's head mass (``kvcmas_recompute_mass_fraction``).
This study ranks selectors for the extra picks at equal budgets, the way the server applies
them, on the role adapters' own transcript:

- ``tail``: a longer tail;
- ``mass``: the centroid's attention mass on the head (mean over heads and the server's probe
  layers 2, 6, 10, ...), what the server ranks by today;
- ``delta0``: the layer-0 K/V deviation between the reader's adapter and the centroid's, which
  depends on the token id alone (a table per adapter a server could build at launch);
- ``dev1``: the layer-1 value deviation (CacheBlend's selector; a server pays a two-layer pass of
  the reader over every borrowed token for it);
- ``own``: the reader's own earlier messages (latest first), which it computed exactly when it
  wrote them and reads back through the centroid;
- ``random`` (seeded), and ``oracle``: the true K/V deviation energy summed over layers, from
  the reader's exact prefill (the ceiling of any selector).

Transcripts (``--shape``): ``chain``, each role's message in turn (plan, solve, critique), every
point a reader that did not write the newest message (the two other agents after each
message); ``panel``, as the serving benchmark's quick panel, every round all three roles answer
the same transcript and their answers are appended together, every point each role reading
after a round (unlike the server, which keeps a reader's own earlier prompt exact, only the head
is exact here). The reader's turn opener is appended; fidelity over a teacher-forced
continuation of its exact greedy output (top-1, mean KL), against the reader's exact prefill.
``base`` is the centroid's KV with only the last token recomputed (what the defaults are worth
is ``default`` against it); ``one_start`` takes the boundary tokens at the first message only
(as a server whose new messages arrive in one prefill, one span, would); ``boundary4`` /
``boundary16`` take 4 / 16 at every message instead of 8.

    python benchmark/lab/lora_selector_study.py [--questions 1] [--shape chain|panel]
        [--model-path NAME]

Writes ``benchmark/lab/results/lora_selector_study[_panel][_<model>].{jsonl,txt}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from sglang_kvcmas.adapters import ROLES, role_adapter_dir
from sglang_kvcmas.adapters.role_data import SYSTEM, TURN_OPENER
from sglang_kvcmas.attention.span_reads import head_mass
from sglang_kvcmas.policy.lora_share import (
    LORA_RECOMPUTE_BOUNDARY,
    LORA_RECOMPUTE_TAIL,
)
from sglang_kvcmas_bench.lab.reference import (
    encode,
    load_lab_model,
    make_reference,
    teacher_forced_logits,
)
from sglang_kvcmas_bench.model_arg import add_model_arg, model_from_args
from sglang_kvcmas_bench.results import record
from sglang_kvcmas_examples.datasets import gsm8k
from sglang_kvcmas_lab.correction.fidelity import teacher_forced
from sglang_kvcmas_lab.correction.lora_forward import AgentModel, LoraForward
from sglang_kvcmas_lab.correction.lora_weights import MEAN_AGENT, AdapterSet
from sglang_kvcmas_lab.models.reference_llama import KVCache, keys_with_past, rotate

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_OUT = RESULTS / "lora_selector_study"
BOUNDARY, TAIL = LORA_RECOMPUTE_BOUNDARY, LORA_RECOMPUTE_TAIL
"""The server's LoRA picks: the first tokens of every message, the prompt's last."""
PROBE_EVERY, PROBE_FIRST = 4, 2
"""The server's head-mass probe layers: 2, 6, 10, ..."""
SELECTORS = ("tail", "mass", "own", "delta0", "dev1", "random", "oracle")
BUDGETS = (0.05, 0.10, 0.25)
"""Extra picks as a share of the borrowed tokens (beyond the defaults)."""
ROW_ORDER = ("base", "one_start", "boundary4", "default", "boundary16", *SELECTORS)
"""The summary's row order: the fixed pick sets, then the selectors."""


def log(msg: str) -> None:
    print(f"[lora_selector_study {time.strftime('%H:%M:%S')}] {msg}", flush=True)


@dataclass(frozen=True)
class Point:
    """One reader over one prefix of the transcript, ``after`` a role's message or a round on
    question ``question``. ids: [T] (head + block, the reader's opener last); head_len: the
    system prompt's tokens; starts: block offsets where messages (and the opener) begin;
    owners: the agent that wrote each of those messages (None: a user message or the opener)."""

    reader: int
    after: str
    question: int
    ids: torch.Tensor
    head_len: int
    starts: tuple[int, ...]
    owners: tuple[int | None, ...]

    def own(self) -> torch.Tensor:
        """[n] bool over the block: tokens of the reader's own earlier messages."""
        n = self.ids.numel() - self.head_len
        out = torch.zeros(n, dtype=torch.bool)
        ends = (*self.starts[1:], n)
        for start, end, owner in zip(self.starts, ends, self.owners):
            out[start:end] = owner == self.reader
        return out


def build_points(lora: LoraForward, tok, questions: list[str], max_message: int,
                 shape: str = "chain", rounds: int = 2) -> list[Point]:
    """The no-sharing transcript and its reading points: ``chain``, each role's greedy message in
    turn; ``panel``, ``rounds`` rounds of every role answering the same transcript."""
    end_id = tok.convert_tokens_to_ids("<|im_end|>")
    head = encode(tok, f"<|im_start|>system\n{SYSTEM}<|im_end|>\n")
    opener, closer = encode(tok, TURN_OPENER), encode(tok, "\n")
    msgs: list[torch.Tensor] = []
    owners: list[int | None] = []
    points: list[Point] = []

    def answer(agent: int) -> torch.Tensor:
        ids = torch.cat([head, *msgs, opener])
        model = AgentModel(lora, agent)
        out = model.forward(ids)
        gen = model.greedy(out.kv, out.logits[-1], max_message, stop=end_id)
        if gen[-1] != end_id:
            gen.append(end_id)
        log(f"q{qi} {ROLES[agent]}: {tok.decode(gen[:-1])!r}"[:200])
        return torch.cat([opener, torch.tensor(gen), closer])

    def read(after: str, readers: list[int]) -> None:
        lens = [m.numel() for m in msgs] + [opener.numel()]
        starts = tuple(int(s) for s in torch.tensor([0, *lens[:-1]]).cumsum(0))
        prompt = torch.cat([head, *msgs, opener])
        points.extend(Point(r, after, qi, prompt, head.numel(), starts, (*owners, None))
                      for r in readers)

    for qi, q in enumerate(questions):
        msgs.append(encode(tok, f"<|im_start|>user\n{q}<|im_end|>\n"))
        owners.append(None)
        if shape == "panel":
            for k in range(rounds):
                answers = [answer(agent) for agent in range(len(ROLES))]
                msgs.extend(answers)
                owners.extend(range(len(ROLES)))
                read(f"round{k + 1}", list(range(len(ROLES))))
            continue
        for agent in range(len(ROLES)):
            msgs.append(answer(agent))
            owners.append(agent)
            read(ROLES[agent], [r for r in range(len(ROLES)) if r != agent])
    return points


@torch.inference_mode()
def centroid_pass(lora: LoraForward, ids: torch.Tensor,
                  head_len: int) -> tuple[KVCache, torch.Tensor]:
    """The centroid's prefill of ``ids: [T]`` and each token's attention mass on the head
    ``[0, head_len)``, mean over the probe layers. Returns (KVCache, mass [T])."""
    s = lora.spec
    pos = torch.arange(ids.numel())
    h = lora.ref.embed(ids)
    ks, vs, probes = [], [], []
    for layer in range(s.num_layers):
        _, q, k, v = lora.qkv(layer, h, MEAN_AGENT)
        ks.append(k)
        vs.append(v)
        if layer >= PROBE_FIRST and (layer - PROBE_FIRST) % PROBE_EVERY == 0:
            qr = rotate(q, pos, s.rope_theta).transpose(0, 1)
            kr = rotate(k, pos, s.rope_theta).transpose(0, 1)
            probes.append(head_mass(qr, kr, pos, pos, s.head_dim**-0.5, 0, head_len))
        h = lora.finish_layer(layer, h, lora.ref.attend(q, pos, k, v, pos), MEAN_AGENT)
    return KVCache(ks, vs, pos), torch.stack(probes).mean(0)


@torch.inference_mode()
def reader_view(lora: LoraForward, reader: int, head: KVCache, base: KVCache,
                block_ids: torch.Tensor, sel: torch.Tensor) -> tuple[KVCache, torch.Tensor]:
    """The reader's cache when it recomputes block tokens ``sel`` ([n] sorted, the last block
    token among them) over the centroid's ``base`` [T] and its own exact ``head``. Returns
    (head + view, logits after the last block token [vocab])."""
    pos = base.positions
    h = lora.ref.embed(block_ids[sel])
    ks, vs = [], []
    for layer in range(lora.spec.num_layers):
        _, q, k, v = lora.qkv(layer, h, reader)
        kb = base.k[layer].index_copy(0, sel, k)
        vb = base.v[layer].index_copy(0, sel, v)
        ks.append(kb)
        vs.append(vb)
        kk, vv, kp = keys_with_past(head, layer, kb, vb, pos)
        h = lora.finish_layer(layer, h, lora.ref.attend(q, pos[sel], kk, vv, kp), reader)
    return KVCache.concat([head, KVCache(ks, vs, pos)]), lora.ref.logits(h[-1:])[0]


def default_picks(n: int, starts: tuple[int, ...], boundary: int = BOUNDARY) -> torch.Tensor:
    """[n] bool: the server's default picks over a block of ``n`` tokens."""
    keep = torch.zeros(n, dtype=torch.bool)
    for s in starts:
        keep[s : s + boundary] = True
    keep[max(0, n - TAIL):] = True
    return keep


def scores(name: str, point: Point, mass: torch.Tensor, exact: KVCache, base: KVCache,
           seed: int) -> torch.Tensor:
    """[n] the selector's ranking score of every block token (larger: picked first)."""
    n = len(base)
    if name == "own":
        return point.own().float() * n + torch.arange(n, dtype=torch.float32)
    if name == "tail":
        return torch.arange(n, dtype=torch.float32)
    if name == "mass":
        return mass
    if name == "random":
        return torch.rand(n, generator=torch.Generator().manual_seed(seed))
    if name == "delta0":
        return ((exact.k[0] - base.k[0]).flatten(1).norm(dim=1)
                + (exact.v[0] - base.v[0]).flatten(1).norm(dim=1))
    if name == "dev1":
        return (exact.v[1] - base.v[1]).flatten(1).norm(dim=1)
    if name == "oracle":
        return sum(((ek - bk).flatten(1).pow(2).sum(1) + (ev - bv).flatten(1).pow(2).sum(1))
                   for ek, bk, ev, bv in zip(exact.k, base.k, exact.v, base.v))
    raise KeyError(name)


def pick(keep: torch.Tensor, score: torch.Tensor, extra: int) -> torch.Tensor:
    """Sorted indices: ``keep`` plus the ``extra`` best-scored tokens outside it."""
    free = (~keep).nonzero().flatten()
    top = free[torch.topk(score[free].float(), min(extra, free.numel())).indices]
    out = keep.clone()
    out[top] = True
    return out.nonzero().flatten()


def measure(lora: LoraForward, point: Point, cont: int, seed: int) -> list[dict]:
    """Every selector and budget at one point: records of top-1, mean KL and picks."""
    model = AgentModel(lora, point.reader)
    ref = make_reference(model, point.ids, cont)
    hl = point.head_len
    head = ref.cache.slice(0, hl)
    exact = ref.cache.slice(hl, point.ids.numel())
    cbase, mass = centroid_pass(lora, point.ids, hl)
    base, mass = cbase.slice(hl, point.ids.numel()), mass[hl:]
    block = point.ids[hl:]
    n = block.numel()
    keep = default_picks(n, point.starts)
    last = torch.zeros(n, dtype=torch.bool)
    last[-1] = True

    def fid(sel: torch.Tensor) -> dict:
        cache, logits = reader_view(lora, point.reader, head, base, block, sel)
        tf = teacher_forced(ref.tf_logits, teacher_forced_logits(model, cache, logits,
                                                                 ref.cont_ids))
        return {"top1": tf.top1, "mean_kl": tf.mean_kl, "picked": int(sel.numel()),
                "borrowed": n}

    variants = {"one_start": default_picks(n, point.starts[:1]), "default": keep,
                "boundary4": default_picks(n, point.starts, 4),
                "boundary16": default_picks(n, point.starts, 16)}
    rows = [{"selector": "base", "budget": 0.0, **fid(last.nonzero().flatten())}]
    rows += [{"selector": name, "budget": 0.0, **fid(picks.nonzero().flatten())}
             for name, picks in variants.items()]
    for name in SELECTORS:
        score = scores(name, point, mass, exact, base, seed)
        for budget in BUDGETS:
            rows.append({"selector": name, "budget": budget,
                         **fid(pick(keep, score, round(budget * n)))})
    return rows


def summarize(records: list[dict]) -> str:
    """Mean top-1, KL and KL recovered (against ``base``) per selector and budget."""
    cases = sorted({(r["question"], r["after"], r["reader"]) for r in records})
    base_kl = {c: r["mean_kl"] for r in records for c in [(r["question"], r["after"], r["reader"])]
               if r["selector"] == "base"}
    keys = sorted({(r["selector"], r["budget"]) for r in records},
                  key=lambda k: (ROW_ORDER.index(k[0]), k[1]))
    lines = [f"{len(cases)} points; KL recovered = 1 - KL / KL(base), mean over points",
             f"{'selector':<9} {'extra':>6} {'picked':>7} {'top1':>6} {'KL':>8} {'KL rec':>7}"]
    for sel, budget in keys:
        rows = [r for r in records if r["selector"] == sel and r["budget"] == budget]
        rec = [1 - r["mean_kl"] / base_kl[(r["question"], r["after"], r["reader"])]
               for r in rows if base_kl[(r["question"], r["after"], r["reader"])] > 0]
        share = statistics.mean(r["picked"] / r["borrowed"] for r in rows)
        lines.append(
            f"{sel:<9} {budget:>6.2f} {share:>7.2f} "
            f"{statistics.mean(r['top1'] for r in rows):>6.3f} "
            f"{statistics.mean(r['mean_kl'] for r in rows):>8.4f} "
            f"{statistics.mean(rec) if rec else float('nan'):>7.2f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--questions", type=int, default=1)
    ap.add_argument("--first-question", type=int, default=0)
    ap.add_argument("--max-message", type=int, default=64)
    ap.add_argument("--cont", type=int, default=24, help="teacher-forced continuation tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shape", choices=("chain", "panel"), default="chain")
    ap.add_argument("--rounds", type=int, default=2, help="panel rounds per question")
    ap.add_argument("--out", type=Path, default=None)
    add_model_arg(ap)
    args = ap.parse_args()
    model = model_from_args(ap, args)
    default = DEFAULT_OUT if args.shape == "chain" else DEFAULT_OUT.with_name(
        f"{DEFAULT_OUT.name}_panel")
    out = model.out_or_named(args.out, default)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    tok, ref = load_lab_model(model)
    adapters = AdapterSet.from_peft_dirs(
        {r: role_adapter_dir("attn", r, model.name) for r in ROLES}, ref.spec.num_layers)
    lora = LoraForward(ref, adapters)
    items = gsm8k()[args.first_question : args.first_question + args.questions]
    points = build_points(lora, tok, [it.question for it in items], args.max_message,
                          args.shape, args.rounds)
    records = []
    with open(out.with_suffix(".jsonl"), "w") as fh:
        for i, p in enumerate(points):
            t0 = time.perf_counter()
            for row in measure(lora, p, args.cont, args.seed + i):
                rec = {"model": model.name, "question": args.first_question + p.question,
                       "shape": args.shape, "after": p.after, "reader": ROLES[p.reader], **row}
                records.append(rec)
                fh.write(json.dumps(rec) + "\n")
            log(f"point {i + 1}/{len(points)} ({ROLES[p.reader]}, {p.ids.numel()} tokens) "
                f"in {time.perf_counter() - t0:.1f} s")
    command = " ".join(["python benchmark/lab/lora_selector_study.py", *sys.argv[1:]])
    text = (f"# command: {command}\nmodel {model.name}; {args.shape}; {args.questions} "
            f"question(s)\n"
            + summarize(records))
    about = (f"LoRA readers' picks by selector and budget ({model.name}, {args.shape}, "
             f"{args.questions} question(s), {len(points)} read points)")
    record(out.with_suffix(".jsonl"), None, what=f"{about}: one record per point and selector")
    record(out.with_suffix(".txt"), text + "\n", what=f"{about}: the summary", command=command)
    print(text)


if __name__ == "__main__":
    main()

"""Which path each forward batch took on SGLang's Triton backend: owners and plain batches on
SGLang's kernels, readers on ours, nothing on the torch fallback.

One sharing server per model with ``--attention-backend triton`` in Triton's interpreter
(``TRITON_INTERPRET=1``: SGLang's Triton kernels and our delta kernels run on CPU tensors, as
they would on a GPU), the spare pass off so readers borrow on an idle server. Two agents with
different heads: both answer a GSM8K question (owners), the first extends the transcript with an
essay passage (owner, head-mass probes), the second reads it (reader, re-positioned), then the
same again one passage further (the reader now also reads its factored leaves). Greedy,
``--new-tokens`` each; the same turns on our torch path (``kvcmas_delta``, no interpreter) give
the texts the kernels' are compared with. The server's own counters (``/server_info`` →
``internal_states[i].kvcmas.dispatch``, the same as ``kvcmas:forward_batches_total{path,
reason}``) say where every forward batch went.

Models: the embedded SmolLM2-135M (Llama) and a tiny random-weight Qwen2 built here (2 layers,
head size 64 as in the Qwen2 family; its answers mean nothing, its layout is what is checked).

    python benchmark/serving/dispatch_check.py --quick   # both models, about 10 minutes

Ends with one line per model, ``DISPATCH model= owner_batches_on_stock= plain_batches_on_stock=
torch_fallback_batches= reader_rows_on_kernel=`` (reader: batches with a row that reads
borrowed KV); writes ``results/dispatch_check[_quick].json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from sglang_kvcmas.integration.dispatch_route import KERNEL, PROBE, READER, STOCK, TORCH
from sglang_kvcmas.models.resolve import resolve_model_path
from sglang_kvcmas_bench.model_arg import BenchModel
from sglang_kvcmas_bench.results import record
from sglang_kvcmas_bench.reuse_records import of_meta
from sglang_kvcmas_bench.server_arms import NO_SPARE_PASS, ArmServer, kvcmas_state, run_header
from sglang_kvcmas_bench.server_calls import generate
from sglang_kvcmas_bench.tiny_models import tiny_qwen2
from sglang_kvcmas_bench.workflows import chat_prompt_ids
from sglang_kvcmas_examples import datasets

RESULTS = Path(__file__).resolve().parent / "results"
HEADS = (("You are Ada, a careful mathematician who checks every step and states the final "
          "answer as a number."),
         ("You are Ben, a skeptical reviewer who looks for the one most likely mistake before "
          "agreeing."))
ENV = {"TRITON_INTERPRET": "1", **NO_SPARE_PASS}


def say(text: str) -> None:
    print(f"[dispatch_check] {text}", file=sys.stderr, flush=True)


def turns(tok, passage_chars: int) -> list[tuple[str, list[int]]]:
    """(name, prompt ids): owners on the question, then twice the first agent owns a longer
    transcript and the second reads it."""
    question = datasets.gsm8k()[0].question
    essays = datasets.essays()
    one = f"{question}\n\nBackground reading:\n{essays[0][1][:passage_chars]}"
    two = f"{one}\n\nMore reading:\n{essays[1][1][:passage_chars]}"

    def ids(head: str, user: str) -> list[int]:
        return chat_prompt_ids(tok, [{"role": "system", "content": head},
                                     {"role": "user", "content": user}])

    return [("owner_a1", ids(HEADS[0], question)), ("owner_b1", ids(HEADS[1], question)),
            ("owner_a2", ids(HEADS[0], one)), ("reader_b2", ids(HEADS[1], one)),
            ("owner_a3", ids(HEADS[0], two)), ("reader_b3", ids(HEADS[1], two))]


def ratios(dispatch: dict) -> dict:
    """The headline's figures from a dispatch snapshot (``{path: {reason: batches}}``)."""
    batches = dispatch.get("forward_batches", {})

    def n(path: str, reason: str | None = None) -> int:
        counts = batches.get(path, {})
        return sum(counts.values()) if reason is None else counts.get(reason, 0)

    def share(part: int, whole: int) -> float | None:
        return part / whole if whole else None

    owners = n(STOCK, PROBE) + n(TORCH, "probe_on_torch_native")
    readers = n(KERNEL, READER) + n(TORCH, "no_kernel") + n(TORCH, "leaves_out_of_order")
    plain = sum(c.get("plain", 0) for c in batches.values())
    return {"owner_batches_on_stock": share(n(STOCK, PROBE), owners),
            "plain_batches_on_stock": share(n(STOCK, "plain"), plain),
            "torch_fallback_batches": n(TORCH),
            "reader_rows_on_kernel": share(n(KERNEL, READER), readers),
            "batches": {"owner": owners, "plain": plain, "reader": readers}}


def check_model(name: str, folder: Path, new_tokens: int, passage_chars: int,
                logs: Path) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    prompts = turns(tok, passage_chars)
    out: dict = {"model": name, "turns": []}
    t0 = time.monotonic()
    with ArmServer("kvcmas", logs / f"dispatch_{name}.log",
                   ["--model-path", str(folder), "--attention-backend", "triton"], env=ENV,
                   boot_timeout_s=900) as server:
        for turn, ids in prompts:
            t = time.monotonic()
            reply = generate(server.url, ids, new_tokens)
            out["turns"].append({"turn": turn, "prompt_tokens": len(ids),
                                 "borrowed": of_meta(reply["meta_info"]).get("borrowed", 0),
                                 "text": reply["text"],
                                 "seconds": round(time.monotonic() - t, 1)})
            say(f"{name} {turn}: {len(ids)} tokens, borrowed "
                f"{out['turns'][-1]['borrowed']}, {out['turns'][-1]['seconds']} s")
        out["dispatch"] = kvcmas_state(server.url).get("dispatch", {})
    # The same turns on our torch path (kvcmas_delta, no interpreter): the kernels' answers.
    with ArmServer("kvcmas", logs / f"dispatch_{name}_torch.log",
                   ["--model-path", str(folder)], env=NO_SPARE_PASS,
                   boot_timeout_s=900) as server:
        torch_texts = [generate(server.url, ids, new_tokens)["text"] for _, ids in prompts]
    out["same_text_as_torch_path"] = sum(
        t["text"] == x for t, x in zip(out["turns"], torch_texts))
    out.update(ratios(out["dispatch"]))
    out["seconds"] = round(time.monotonic() - t0, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 new tokens, 600-character passages")
    ap.add_argument("--models", default="embedded,tiny-qwen2",
                    help="comma-separated: embedded, tiny-qwen2, or a model folder")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    new_tokens, passage_chars = (4, 600) if args.quick else (8, 1500)
    out = args.out or RESULTS / f"dispatch_check{'_quick' if args.quick else ''}.json"
    logs = RESULTS / "dispatch_check"
    logs.mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in [m for m in args.models.split(",") if m]:
            if name == "embedded":
                folder = resolve_model_path(None)
            elif name == "tiny-qwen2":
                folder = tiny_qwen2(Path(tmp) / "tiny-qwen2", hidden_size=256, heads=4,
                                    kv_heads=2)
            else:
                folder = Path(name)
            say(f"{name}: {folder}")
            results.append(check_model(name, folder, new_tokens, passage_chars, logs))
    result = {**run_header("benchmark/serving/dispatch_check.py", argv,
                           BenchModel.resolve("embedded")),
              "model": "embedded SmolLM2-135M-Instruct and a tiny random Qwen2",
              "new_tokens": new_tokens, "passage_chars": passage_chars, "models": results}
    record(out, json.dumps(result, indent=1) + "\n", command=result["command"],
           what="forward batches by path on SGLang's Triton backend in Triton's interpreter: "
                "owners and plain on stock, readers on our kernels, torch fallback")
    ok = True
    for r in results:
        def fmt(x: float | None) -> str:
            return "nan" if x is None else f"{x:.2f}"

        ok &= (r["owner_batches_on_stock"] == 1.0 and r["plain_batches_on_stock"] == 1.0
               and r["torch_fallback_batches"] == 0 and r["reader_rows_on_kernel"] == 1.0)
        print(f"DISPATCH model={r['model']} "
              f"owner_batches_on_stock={fmt(r['owner_batches_on_stock'])} "
              f"plain_batches_on_stock={fmt(r['plain_batches_on_stock'])} "
              f"torch_fallback_batches={r['torch_fallback_batches']} "
              f"reader_rows_on_kernel={fmt(r['reader_rows_on_kernel'])}")
        say(f"{r['model']}: same text as the torch path in {r['same_text_as_torch_path']} of "
            f"{len(r['turns'])} turns; batches {r['batches']}")
    say(f"wrote {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Smoke test of one model behind our launcher with sharing on: boot, reuse, speed, one answer.

    python benchmark/serving/model_smoke.py --model-path qwen2.5-coder-0.5b [--out FILE] [-- flags]

Boots ``sglang_kvcmas.launch_server --model-path NAME --kvcmas-share-context`` with our defaults
(or uses ``--url``), then, one request at a time, over OpenAI chat completions (ChatML):

1. both agents' heads cached: agents A and B (different system prompts) say hello;
2. owner: A reads a ~``--transcript-tokens`` user transcript (GSM8K questions), 1 new token:
   prefill tok/s = tokens it computed / request wall time;
3. reader: B reads the same transcript: ``usage.prompt_tokens_details`` must report borrowed
   (``kvcmas_reused_repositioned``) tokens;
4. decode tok/s over ``/generate``: 64 new tokens (``ignore_eos``), (completion - 1) / (e2e -
   first-token latency) from ``meta_info``;
5. one GSM8K question (greedy, at most ``--answer-tokens``) answered by agent A: the answer and
   whether its last number is the reference (not judged when cut at the token limit).

Prints a summary (the first line is the command) and writes it to ``--out`` when given. Exit
status 1 when the reader borrowed nothing.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from pathlib import Path

import requests
from sglang_kvcmas.models.resolve import resolve_model_path
from sglang_kvcmas.server.process import ServerProcess
from sglang_kvcmas_bench.results import record
from sglang_kvcmas_examples import datasets

SYSTEM_A = "You are Ada, a careful mathematician. Solve problems step by step."
SYSTEM_B = "You are Ben, a skeptical reviewer. Check every step of the reasoning you read."
GSM8K_SYSTEM = ("You are Ada, a careful mathematician. Solve the problem step by step, then "
                "end with a line 'The answer is N.'")


def chat(url: str, system: str, user: str, max_tokens: int) -> tuple[dict, float]:
    """One greedy chat completion; returns (response JSON, wall seconds)."""
    start = time.perf_counter()
    r = requests.post(f"{url}/v1/chat/completions", timeout=900, json={
        "model": "default", "temperature": 0, "max_tokens": max_tokens,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]})
    r.raise_for_status()
    return r.json(), time.perf_counter() - start


def transcript(model_folder: Path, tokens: int) -> str:
    """GSM8K questions joined until the user message reaches ``tokens`` tokens (this model's
    tokenizer)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_folder))
    text = "Transcript of the problems under discussion:\n"
    for i, item in enumerate(datasets.gsm8k()[1:], start=1):
        text += f"Problem {i}: {item.question}\n"
        if len(tok.encode(text, add_special_tokens=False)) >= tokens:
            break
    return text


def decode_rate(url: str) -> float:
    """Decode tokens per second of one request (64 new tokens after a short prompt)."""
    r = requests.post(f"{url}/generate", timeout=900, json={
        "text": "Write a long story about a lighthouse keeper.",
        "sampling_params": {"temperature": 0, "max_new_tokens": 64, "ignore_eos": True}})
    r.raise_for_status()
    meta = r.json()["meta_info"]
    return (meta["completion_tokens"] - 1) / (meta["e2e_latency"] - meta["first_token_latency"])


def run(url: str, model_folder: Path, transcript_tokens: int, answer_tokens: int, say) -> bool:
    """The smoke steps against ``url``; ``say`` prints a summary line. True: the reader borrowed."""
    text = transcript(model_folder, transcript_tokens)
    for system in (SYSTEM_A, SYSTEM_B):
        chat(url, system, "Hello.", 1)
    owner, owner_s = chat(url, SYSTEM_A, text, 1)
    od = owner["usage"]["prompt_tokens_details"]
    say(f"owner (agent A): prompt {owner['usage']['prompt_tokens']} tokens, computed "
        f"{od['kvcmas_recomputed']} in {owner_s:.2f} s: prefill "
        f"{od['kvcmas_recomputed'] / owner_s:.1f} tok/s")
    reader, reader_s = chat(url, SYSTEM_B, text, 1)
    rd = reader["usage"]["prompt_tokens_details"]
    borrowed = rd["kvcmas_reused_repositioned"]
    say(f"reader (agent B): prompt {reader['usage']['prompt_tokens']} tokens in {reader_s:.2f} s:"
        f" borrowed (reused_repositioned) {borrowed}, recomputed {rd['kvcmas_recomputed']} (of "
        f"them borrowed {rd['kvcmas_recomputed_borrowed']}), own exact {rd['kvcmas_reused_exact']}")
    say(f"decode: {decode_rate(url):.1f} tok/s (64 tokens, one request)")
    item = datasets.gsm8k()[0]
    answer, answer_s = chat(url, GSM8K_SYSTEM, item.question, answer_tokens)
    content = answer["choices"][0]["message"]["content"]
    got = datasets.last_number(content)
    verdict = ("cut at the token limit" if answer["choices"][0]["finish_reason"] == "length"
               else "correct" if got == item.final else "wrong")
    say(f"GSM8K #0 ({answer['usage']['completion_tokens']} tokens in {answer_s:.1f} s): "
        f"last number {got}, reference {item.final}: {verdict}")
    say("answer: " + content.strip().replace("\n", "\n        "))
    return borrowed > 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-path", default="embedded", help="a short name, HF folder or .gguf")
    p.add_argument("--url", help="use this running server (started with --kvcmas-share-context)")
    p.add_argument("--transcript-tokens", type=int, default=400)
    p.add_argument("--answer-tokens", type=int, default=384, help="GSM8K answer token limit")
    p.add_argument("--out", type=Path, help="also write the summary here")
    p.add_argument("server_args", nargs=argparse.REMAINDER,
                   help="after '--': extra flags for sglang-kvcmas-server")
    args = p.parse_args(argv)
    extra = [a for a in args.server_args if a != "--"]
    lines = ["# " + shlex.join(["python", "benchmark/serving/model_smoke.py",
                                *(argv if argv is not None else sys.argv[1:])])]

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    print(lines[0], flush=True)
    folder = resolve_model_path(args.model_path)
    if args.url:
        ok = run(args.url, folder, args.transcript_tokens, args.answer_tokens, say)
    else:
        log = Path(tempfile.gettempdir()) / f"kvcmas-model-smoke-{Path(folder).name}.log"
        server = ServerProcess(
            args=["--model-path", args.model_path, "--kvcmas-share-context", *extra],
            log_path=log, boot_timeout_s=600,
            on_wait=lambda s, last: print(f"  booting… {s:.0f} s: {last}", flush=True))
        start = time.monotonic()
        with server:
            launched = next((ln for ln in log.read_text(errors="replace").splitlines()
                             if "launching SGLang" in ln), "")
            fraction = launched.split("--mem-fraction-static ")[-1].split()[0] if (
                "--mem-fraction-static" in launched) else "?"
            say(f"model {args.model_path} ({folder.name}): booted in "
                f"{time.monotonic() - start:.0f} s, --mem-fraction-static {fraction} (log {log})")
            ok = run(server.url, folder, args.transcript_tokens, args.answer_tokens, say)
    say(f"SMOKE model={args.model_path} borrowed={'yes' if ok else 'no'}")
    if args.out:
        record(args.out, "\n".join(lines) + "\n",
               what=f"{args.model_path} ({folder.name}) with sharing on: boot, prefill / decode "
                    f"tok/s, tokens a second agent borrows, one GSM8K answer: `{lines[-1]}`")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

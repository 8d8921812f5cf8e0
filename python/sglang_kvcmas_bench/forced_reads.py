"""Teacher-forced reads against an exact prefill, inside the server: a reader's prompt forced
over a continuation (``forced``), what it recomputes set per request (``config``:
boundary, mass fraction, tail), and how close two reads are (``compare``: top-1, KL on the exact
read's top-20, |Δ log p|, top-2 gaps and flips)."""

from __future__ import annotations

import math
import statistics
import time

from sglang_kvcmas_bench.reuse_records import of_meta
from sglang_kvcmas_bench.server_calls import generate

TOP = 20


def parse_config(text: str) -> tuple[int, float, int]:
    """``boundary:mass[:tail]`` -> (boundary tokens, mass fraction, tail tokens)."""
    parts = text.split(":")
    if len(parts) not in (2, 3):
        raise SystemExit(f"--configs: expected boundary:mass[:tail], got {text!r}")
    return int(parts[0]), float(parts[1]), int(parts[2]) if len(parts) == 3 else 0


def config_name(boundary: int, mass: float, tail: int) -> str:
    return f"{boundary}:{float(mass)}" + (f":{tail}" if tail else "")


def forced(url: str, ids: list[int], cont: list[int], salt: str | None = None,
           config: tuple[int, float, int] | None = None, custom: dict | None = None,
           body: dict | None = None) -> dict:
    """Teacher-force ``cont`` after ``ids``: top-20 per position, the forced tokens' logprobs.
    ``config``: (boundary tokens, mass fraction, tail tokens) the reader recomputes; ``custom``:
    any other ``custom_params`` (``record`` is then the reuse record as served); ``body``: more
    request fields (e.g. ``lora_path``)."""
    if config is not None:
        custom = {**(custom or {}), "kvcmas_recompute_boundary": config[0],
                  "kvcmas_recompute_mass_fraction": config[1], "kvcmas_recompute_tail": config[2]}
    sampling = {} if custom is None else {"custom_params": custom}
    t0 = time.perf_counter()
    # From the last prompt token on: SGLang gives no logprob for the token at logprob_start_len
    # itself, so entry k + 1 is the prediction of cont[k] (cont[0] included).
    res = generate(url, ids + cont, 1, salt, return_logprob=True, logprob_start_len=len(ids) - 1,
                   top_logprobs_num=TOP, sampling=sampling, **(body or {}))
    wall = time.perf_counter() - t0
    meta = res["meta_info"]
    tops = [{t: lp for lp, t, _ in (top or [])} for top in meta["input_top_logprobs"][1:]]
    chosen = [x[0] for x in meta["input_token_logprobs"][1:]]
    n = min(len(cont), len(tops))
    return {"tops": tops[:n], "chosen": chosen[:n], "wall_s": wall,
            "ttft_s": meta.get("first_token_latency"),
            "reuse": of_meta(meta), "record": (meta.get("kvcmas_reuse") or [{}])[0]}


def kl_on_support(ref: dict[int, float], got: dict[int, float]) -> float:
    """KL(ref || got) of both distributions renormalized on ref's top-20 tokens (a token missing
    from got's top-20 gets got's smallest listed logprob, an upper bound on its mass)."""
    floor = min(got.values())
    p = {t: math.exp(lp) for t, lp in ref.items()}
    q = {t: math.exp(got.get(t, floor)) for t in ref}
    zp, zq = sum(p.values()), sum(q.values())
    return sum(pi / zp * math.log((pi / zp) / (q[t] / zq)) for t, pi in p.items() if pi > 0)


def compare(ref: dict, got: dict, cont: list[int]) -> dict:
    """Top-1 agreement, KL20 and |Δ log p| over the forced positions; and at every position the
    exact computation's top-2 gap (log p1 − log p2 of its two best tokens) and how far the
    reader moved that gap, with the flipped positions listed (a flip needs the move to exceed
    the gap, so the two together say how much closer a correction must get)."""
    top1, kl, dlp, gaps, moves, flips = [], [], [], [], [], []
    for i, tok in enumerate(cont[: len(ref["tops"])]):
        r, g = ref["tops"][i], got["tops"][i]
        if not r or not g:
            continue
        same = max(r, key=r.get) == max(g, key=g.get)
        top1.append(same)
        kl.append(kl_on_support(r, g))
        if ref["chosen"][i] is not None and got["chosen"][i] is not None:
            dlp.append(abs(ref["chosen"][i] - got["chosen"][i]))
        if len(r) >= 2:
            (t1, l1), (t2, l2) = sorted(r.items(), key=lambda kv: -kv[1])[:2]
            floor = min(g.values())
            gap, moved = l1 - l2, (l1 - l2) - (g.get(t1, floor) - g.get(t2, floor))
            gaps.append(gap)
            moves.append(abs(moved))
            if not same:
                flips.append({"pos": i, "gap": gap, "move": moved})
    return {"top1": statistics.fmean(top1), "kl20": statistics.fmean(kl),
            "dlogp": statistics.fmean(dlp), "n": len(top1), "gaps": gaps, "gap_moves": moves,
            "flips": flips}

"""The kvcmas lab's transcript, method independent: every turn of a workload generated densely
(no sharing), with the no-sharing reference each method is judged against."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from sglang_kvcmas_lab.models.reference_llama import RefLlama

from sglang_kvcmas_bench.lab.reference import Reference, encode, make_reference
from sglang_kvcmas_bench.lab.workloads import END, SUFFIX, Workload


@dataclass
class Turn:
    """One planned turn with its dense reference. seg_ids: ids of every shared segment in the
    prompt (index 0 = the task); suffix_ids; answer segment ids (suffix + answer + end)."""

    agent: str
    round: int
    seg_ids: list[torch.Tensor]
    suffix_ids: torch.Tensor
    answer_seg: torch.Tensor
    ref: Reference


@dataclass
class Transcript:
    workload: Workload
    heads: dict[str, torch.Tensor]
    turns: list[Turn] = field(default_factory=list)


def make_transcript(model: RefLlama, tok, wl: Workload, answer_tokens: int, cont_tokens: int,
                    log) -> Transcript:
    """Dense (no sharing) generation of every turn: prompts, references and answers."""
    heads = {a: encode(tok, wl.head_text(a)) for a in wl.agents}
    task = encode(tok, wl.task_segment_text())
    suffix = encode(tok, SUFFIX)
    end = encode(tok, END)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    for a in wl.agents:  # tokenization must compose at our segment boundaries
        full = encode(tok, wl.head_text(a) + wl.task_segment_text() + SUFFIX)
        assert torch.equal(full, torch.cat([heads[a], task, suffix])), "boundary merge"
    tr = Transcript(wl, heads)
    segs = [task]
    for i, plan in enumerate(wl.turns):
        prompt = torch.cat([heads[plan.agent], *segs, suffix])
        t0 = time.perf_counter()
        ref = make_reference(model, prompt, max(cont_tokens, answer_tokens))
        cont = ref.greedy_ids
        ans = cont[:answer_tokens]
        if im_end in ans:
            ans = ans[: ans.index(im_end)]
        ref = Reference(ref.cache, ref.last_logits, ref.cont_ids[:cont_tokens],
                        ref.tf_logits[:cont_tokens], cont[:cont_tokens])
        seg = torch.cat([suffix, torch.tensor(ans, dtype=torch.long), end])
        tr.turns.append(Turn(plan.agent, plan.round, list(segs), suffix, seg, ref))
        segs.append(seg)
        log(f"  [{wl.name}#{wl.instance}] turn {i} {plan.agent}: prompt {prompt.numel()} tok, "
            f"answer {len(ans)} tok ({time.perf_counter() - t0:.1f}s): "
            f"{tok.decode(ans[:24])!r}...")
    return tr

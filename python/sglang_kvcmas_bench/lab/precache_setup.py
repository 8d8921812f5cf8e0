"""The PReCache labs' setup: the embedded model with its role adapters, the no-sharing transcript
of role messages (kept on disk: it depends only on the adapters and the arguments), and a
reader's read of a view judged against its exact computation."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from sglang_kvcmas.adapters import ROLES, role_adapter_dir
from sglang_kvcmas.adapters.role_data import SYSTEM, TURN_OPENER
from sglang_kvcmas_lab.correction.fidelity import kv_relative_error, teacher_forced
from sglang_kvcmas_lab.correction.lora_forward import AgentModel, LoraForward
from sglang_kvcmas_lab.correction.lora_weights import AdapterSet
from sglang_kvcmas_lab.correction.precache_base import Segment
from sglang_kvcmas_lab.models.reference_llama import KVCache, RefLlama

from sglang_kvcmas_bench.lab.reference import encode, teacher_forced_logits
from sglang_kvcmas_bench.model_arg import BenchModel


def log(msg: str) -> None:
    print(f"[precache {time.strftime('%H:%M:%S')}] {msg}", flush=True)


ADAPTERS_ARE_EMBEDDED = ("the PReCache role adapters (sglang_kvcmas/adapters) are trained for the "
                         "embedded model only")


def load(config: str, model: BenchModel | None = None) -> tuple[LoraForward, object]:
    """The embedded model with the role adapters of ``config``, and its tokenizer.

    Raises:
        ModelPathError: ``model`` is not the embedded model (the adapters are its own).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = model or BenchModel.resolve()
    model.require_embedded(ADAPTERS_ARE_EMBEDDED)
    folder = model.folder
    tok = AutoTokenizer.from_pretrained(str(folder))
    ref = RefLlama(AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32))
    adapters = AdapterSet.from_peft_dirs({r: role_adapter_dir(config, r) for r in ROLES},
                                         ref.spec.num_layers)
    return LoraForward(ref, adapters), tok


def build_transcript(lora: LoraForward, tok, questions: list[str], max_message: int,
                     max_tokens: int) -> list[Segment]:
    """System + question, then each role's greedy message (no sharing), per question."""
    end_id = tok.convert_tokens_to_ids("<|im_end|>")
    opener, closer = encode(tok, TURN_OPENER), encode(tok, "\n")
    segs: list[Segment] = []
    for qi, q in enumerate(questions):
        head = (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n" if qi == 0 else "")
        user = encode(tok, head + f"<|im_start|>user\n{q}<|im_end|>\n")
        if sum(s.ids.numel() for s in segs) + user.numel() + 3 * max_message > max_tokens:
            break
        segs.append(Segment(user, None))
        for agent, role in enumerate(ROLES):
            ids = torch.cat([*(s.ids for s in segs), opener])
            model = AgentModel(lora, agent)
            out = model.forward(ids)
            gen = model.greedy(out.kv, out.logits[-1], max_message, stop=end_id)
            if gen[-1] != end_id:
                gen.append(end_id)
            segs.append(Segment(torch.cat([opener, torch.tensor(gen), closer]), agent))
            log(f"q{qi} {role}: {tok.decode(gen[:-1])!r}"[:300])
    return segs


def cached_transcript(out_dir: Path, args, build) -> list[Segment]:
    """The no-sharing transcript depends only on the adapters and these arguments: keep it in
    ``out_dir`` (made if missing)."""
    import hashlib

    h = hashlib.sha256()
    for role in ROLES:
        h.update((role_adapter_dir(args.config, role) / "adapter_model.safetensors").read_bytes())
    h.update(repr((args.config, args.questions, args.first_question, args.max_message,
                   args.max_tokens)).encode())
    path = out_dir / f"transcript_{h.hexdigest()[:16]}.json"
    if path.exists():
        log(f"transcript from {path}")
        return [Segment(torch.tensor(s["ids"]), s["writer"]) for s in json.loads(path.read_text())]
    segs = build()
    out_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([{"ids": s.ids.tolist(), "writer": s.writer} for s in segs]))
    return segs


def fidelity(lora: LoraForward, view: KVCache, reader: int, suffix: torch.Tensor, ref) -> dict:
    """Agent ``reader`` reading ``view`` then ``suffix``, teacher-forced over ``ref`` (its no-
    sharing reference): top-1, KL, greedy match, first divergence, K/V relative error."""
    model = AgentModel(lora, reader)
    out = model.forward(suffix, past=view)
    cache = KVCache.concat([view, out.kv])
    tf_logits = teacher_forced_logits(model, cache, out.logits[-1], ref.cont_ids)
    tf = teacher_forced(ref.tf_logits, tf_logits)
    misses = (tf_logits.argmax(-1) != ref.cont_ids).nonzero()
    first = int(misses[0]) if misses.numel() else ref.cont_ids.numel()
    n = len(view)
    return {"top1": tf.top1, "mean_kl": tf.mean_kl, "max_kl": tf.max_kl,
            "greedy_exact": float(first == ref.cont_ids.numel()), "first_divergence": first,
            "kv_rel_err_k": kv_relative_error([k[:n] for k in ref.cache.k], view.k),
            "kv_rel_err_v": kv_relative_error([v[:n] for v in ref.cache.v], view.v)}

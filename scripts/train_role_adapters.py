#!/usr/bin/env python
"""Train the planner / solver / critic LoRA adapters of a model (the embedded one by default; CPU).

Data: GSM8K items from index 200 on (the labs use items 0-199), turned into role examples by
``sglang_kvcmas.adapters.role_data``; loss on the role's message only; sequences <= 224 tokens.
Batch of one (this is a 2-core CPU). Each adapter: rank 8, alpha 16, no dropout, AdamW, cosine
schedule, fp32 training, saved in peft format with fp16 weights under
python/sglang_kvcmas/adapters/roles/<config>/<role>/.

    OMP_NUM_THREADS=1 python scripts/train_role_adapters.py --config attn --threads 1
    OMP_NUM_THREADS=1 python scripts/train_role_adapters.py --config attn_mlp --threads 1

(the shipped adapters: 120 steps, lr 1e-3, seed 0; 2-6 min each on a shared 2-core CPU).
Another model's (a known name or a Hugging Face folder) go to ``--out``; Qwen2.5-Coder-0.5B's, the
same recipe, 4.5-5 min each, ship under ``roles/qwen2_5_coder_0_5b/``:

    python scripts/train_role_adapters.py --model-path qwen2.5-coder-0.5b \\
        --out python/sglang_kvcmas/adapters/roles/qwen2_5_coder_0_5b
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from sglang_kvcmas.adapters import ADAPTER_CONFIGS, ROLES, role_adapter_dir
from sglang_kvcmas.adapters.role_data import role_examples
from sglang_kvcmas_examples.datasets import gsm8k
from sglang_kvcmas.models.resolve import resolve_model_path

FIRST_TRAIN_ITEM = 200
MAX_LEN = 224


def encode(tok, examples):
    """-> list of (ids [T], num_context): the loss covers ids[num_context:] only."""
    out = []
    for ex in examples:
        ctx = tok(ex.context, add_special_tokens=False)["input_ids"]
        tgt = tok(ex.target, add_special_tokens=False)["input_ids"]
        if len(ctx) + len(tgt) > MAX_LEN:
            continue
        out.append((torch.tensor(ctx + tgt), len(ctx)))
    return out


def sample(data, rng: random.Random):
    """Endless shuffled stream of (ids [T], num_context) examples."""
    while True:
        order = list(range(len(data)))
        rng.shuffle(order)
        yield from (data[j] for j in order)


def train_one(args, role: str, tok, data) -> dict:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)
    base = AutoModelForCausalLM.from_pretrained(str(resolve_model_path(args.model_path)),
                                                dtype=torch.float32)
    cfg = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                     target_modules=list(ADAPTER_CONFIGS[args.config]), task_type="CAUSAL_LM")
    model = get_peft_model(base, cfg)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.steps,
                                                pct_start=0.1, anneal_strategy="cos")
    stream = sample(data, random.Random(args.seed))
    t0, losses = time.perf_counter(), []
    for step in range(1, args.steps + 1):
        # Batch of one, logits only where a target token is predicted: on this CPU the full-vocab
        # head over context tokens would cost ~20% of the step for nothing.
        ids, n_ctx = next(stream)
        keep = torch.arange(n_ctx - 1, ids.numel() - 1)
        logits = model(input_ids=ids[None], logits_to_keep=keep).logits[0]
        loss = torch.nn.functional.cross_entropy(logits.float(), ids[n_ctx:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        if step == 1 or step % 10 == 0 or step == args.steps:
            recent = sum(losses[-20:]) / len(losses[-20:])
            print(f"[train {args.config}/{role}] step {step}/{args.steps} loss {recent:.3f} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    out = args.out / args.config / role if args.out else role_adapter_dir(args.config, role)
    out.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.float16)
    model.save_pretrained(str(out))
    # The shipped config names the embedded model, not this machine's cache path; peft's
    # generated model card says nothing the config does not.
    cfg_path = out / "adapter_config.json"
    cfg_json = json.loads(cfg_path.read_text())
    cfg_json["base_model_name_or_path"] = ("embedded:" + resolve_model_path().name
                                           if args.model_path is None else args.model_path)
    cfg_path.write_text(json.dumps(cfg_json, indent=2, sort_keys=True) + "\n")
    (out / "README.md").unlink(missing_ok=True)
    meta = {"role": role, "config": args.config, "model": args.model_path or "embedded",
            "steps": args.steps, "lr": args.lr,
            "max_len": MAX_LEN, "seed": args.seed, "examples": len(data),
            "first_loss": losses[0], "final_loss": sum(losses[-20:]) / len(losses[-20:]),
            "train_seconds": round(time.perf_counter() - t0, 1)}
    (out / "training.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", choices=sorted(ADAPTER_CONFIGS), default="attn")
    ap.add_argument("--roles", nargs="+", choices=ROLES, default=list(ROLES))
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--num-items", type=int, default=600)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model-path", default=None,
                    help="a known model's name or a Hugging Face folder (default: the embedded "
                         "model, whose adapters ship in the package)")
    ap.add_argument("--out", type=Path, default=None,
                    help="write <out>/<config>/<role>/ (default: the package's adapter folders, "
                         "for the embedded model only)")
    args = ap.parse_args()
    if args.model_path is not None and args.out is None:
        ap.error("--model-path needs --out: the package's adapter folders are the embedded "
                 "model's")
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(resolve_model_path(args.model_path)))
    rng = random.Random(args.seed)
    items = gsm8k()[FIRST_TRAIN_ITEM : FIRST_TRAIN_ITEM + args.num_items]
    examples = [ex for it in items for ex in role_examples(it.question, it.answer, it.final, rng)]
    for role in args.roles:
        data = encode(tok, [ex for ex in examples if ex.role == role])
        print(f"[train {args.config}/{role}] {len(data)} examples", flush=True)
        print(json.dumps(train_one(args, role, tok, data)), flush=True)


if __name__ == "__main__":
    main()

"""Throughput of the 3 agents' turns run as one batch, per sharing method (PReCache lab).

One "batched turn" at the end of the transcript: every agent's critical-path work (the method's
``first_token`` closures, the method's pending shared work done once), then ``num_tokens`` decode
steps with all agents' rows in one batch: base projections as one [N, D] matmul, each row's LoRA
via a batched [N, D, r] product, attention per row over its cache. Rows of a shared-cache method
read the same base tensors (one rotated K0 for all; values P V0 + s (P a) B per row); rows of
no sharing / SGLang / DroidSpeak read their own caches. Decoded tokens are greedy per row.

On a CPU this measures compute only; on a GPU the bytes saved also buy batch size (the
``bytes_ratio`` column), which this number does not include. ``rebase_mean_delta`` rows read
their materialized views (its leaves are not split-read here), so it decodes like no sharing.
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F
from sglang_kvcmas_lab.correction.precache_methods import LowRankShared
from sglang_kvcmas_lab.models.reference_llama import rotate

__all__ = ["batched_decode_throughput"]


def _stack(lora, layer, target, n):
    fs = [lora.adapters.get(layer, target, i) for i in range(n)]
    if fs[0] is None:
        return None
    return torch.stack([f.a for f in fs]), torch.stack([f.b for f in fs]), fs[0].scale


class _Batch:
    """Per-row caches for the decode steps. k_rot/v per layer: [N] lists of [T, Hk, d] (rows
    may share tensors); a_v/b_v per layer: low-rank values per row (or None)."""

    def __init__(self, lora, rows_k, rows_v, rows_av, positions):
        self.lora, self.k, self.v, self.av, self.pos = lora, rows_k, rows_v, rows_av, positions
        self.n = len(rows_k[0])
        self.lw = [{t: _stack(lora, layer, t, self.n) for t in
                    ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")}
                   for layer in range(lora.spec.num_layers)]
        self.new_k = [[] for _ in range(lora.spec.num_layers)]
        self.new_v = [[] for _ in range(lora.spec.num_layers)]

    def proj(self, layer, target, module, x):
        y = module(x)
        w = self.lw[layer][target]
        if w is None:
            return y
        a, b, s = w
        return y + s * torch.bmm(torch.bmm(x[:, None], a), b)[:, 0]

    @torch.inference_mode()
    def step(self, ids: torch.Tensor, pos: int) -> torch.Tensor:
        """ids: [N] one token per row at position pos -> next ids [N]."""
        lora, spec = self.lora, self.lora.spec
        ref = lora.ref
        hk, d = spec.num_kv_heads, spec.head_dim
        g = spec.num_heads // hk
        p = torch.tensor([pos])
        h = ref.embed(ids)
        for layer in range(spec.num_layers):
            blk = ref.decoder.layers[layer]
            att, mlp = blk.self_attn, blk.mlp
            x = blk.input_layernorm(h)
            q = self.proj(layer, "q_proj", att.q_proj, x).view(self.n, spec.num_heads, d)
            k = self.proj(layer, "k_proj", att.k_proj, x).view(self.n, hk, d)
            v = self.proj(layer, "v_proj", att.v_proj, x).view(self.n, hk, d)
            self.new_k[layer].append(rotate(k, p.expand(self.n), spec.rope_theta))
            self.new_v[layer].append(v)
            qr = rotate(q, p.expand(self.n), spec.rope_theta)
            nk, nv = torch.stack(self.new_k[layer], 1), torch.stack(self.new_v[layer], 1)
            outs = []
            for r in range(self.n):
                qh = qr[r].view(hk, g, 1, d)
                kp = self.k[layer][r].permute(1, 2, 0)  # [Hk, d, T]
                s_all = torch.cat([qh @ kp[:, None], qh @ nk[r].permute(1, 2, 0)[:, None]], -1)
                prob = torch.softmax(s_all / math.sqrt(d), -1)
                t_past = kp.shape[-1]
                pp = prob[..., :t_past]
                o = pp @ self.v[layer][r].permute(1, 0, 2)[:, None]
                o = o + prob[..., t_past:] @ nv[r].permute(1, 0, 2)[:, None]
                if self.av[layer][r] is not None:
                    a_v, b_v, s = self.av[layer][r]
                    o = o + s * torch.einsum("kgtr,rkd->kgtd", pp @ a_v, b_v.view(-1, hk, d))
                outs.append(o.reshape(spec.num_heads * d))
            h = h + self.proj(layer, "o_proj", att.o_proj, torch.stack(outs))
            x = blk.post_attention_layernorm(h)
            gate = self.proj(layer, "gate_proj", mlp.gate_proj, x)
            up = self.proj(layer, "up_proj", mlp.up_proj, x)
            h = h + self.proj(layer, "down_proj", mlp.down_proj, F.silu(gate) * up)
        return ref.logits(h).argmax(-1)


def _rows(lora, method, n):
    """Per layer, per row: rotated keys, values, low-rank values for the decode batch."""
    spec = lora.spec
    layers = range(spec.num_layers)
    if isinstance(method, LowRankShared) and method.split_rows:
        st, r = method.store, lora.adapters.rank
        pos = st.base.positions
        k0r = [rotate(st.base.k[i], pos, spec.rope_theta) for i in layers]
        rows_k, rows_v, rows_av = [], [], []
        for i in layers:
            ks, avs = [], []
            for a in range(n):
                ak = st.agent_a(i, "k", a, r)
                if method.keys == "lowrank" and ak is not None:
                    f = lora.adapters.get(i, "k_proj", a)
                    delta = (f.scale * (ak @ f.b)).view_as(st.base.k[i])
                    ks.append(k0r[i] + rotate(delta, pos, spec.rope_theta))
                else:
                    ks.append(k0r[i])
                av = st.agent_a(i, "v", a, r)
                fv = lora.adapters.get(i, "v_proj", a)
                avs.append(None if av is None else (av, fv.b, fv.scale))
            rows_k.append(ks)
            rows_v.append([st.base.v[i]] * n)
            rows_av.append(avs)
        return rows_k, rows_v, rows_av
    views = [method.view(a) for a in range(n)]
    shared = all(v is views[0] for v in views)
    rot = [rotate(views[0].k[i], views[0].positions, spec.rope_theta) for i in layers] \
        if shared else None
    rows_k = [[rot[i] if shared else rotate(v.k[i], v.positions, spec.rope_theta)
               for v in views] for i in layers]
    return rows_k, [[v.v[i] for v in views] for i in layers], [[None] * n for _ in layers]


def batched_decode_throughput(lora, segs, methods: dict, suffix: torch.Tensor, *,
                              num_tokens: int = 16) -> dict[str, dict[str, float]]:
    """{method: {batch_turn_s, decode_tok_s, batch_tok_s}} at the end of the transcript.

    The rows' suffix (turn opener) is folded into their first decode steps, so every method
    decodes ``suffix + num_tokens`` steps; the method's critical path is counted once per row
    (the closures) with pending shared work counted by each closure (as in TTFT).
    """
    n = len(lora.adapters.names)
    total = int(sum(s.ids.numel() for s in segs))
    out = {}
    for name, m in methods.items():
        t0 = time.perf_counter()
        for a in range(n):
            m.first_token(a, suffix)()
        t_pre = time.perf_counter() - t0
        t0 = time.perf_counter()
        rows = _rows(lora, m, n)
        if isinstance(m, LowRankShared):  # rotating each agent's low-rank keys is its work;
            t_pre += time.perf_counter() - t0  # the others' views repeat the closures' prefill
        batch = _Batch(lora, *rows, None)
        ids = suffix[:1].expand(n).clone()
        t1 = time.perf_counter()
        steps = suffix.numel() + num_tokens
        for i in range(steps):
            nxt = batch.step(ids, total + i)
            ids = suffix[i + 1].expand(n).clone() if i + 1 < suffix.numel() else nxt
        t_dec = time.perf_counter() - t1
        out[name] = {"batch_turn_s": t_pre + t_dec, "decode_tok_s": n * steps / t_dec,
                     "batch_tok_s": n * num_tokens / (t_pre + t_dec)}
    return out

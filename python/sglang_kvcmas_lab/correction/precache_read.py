"""Agent reads of a ``LowRankKVCache`` without materializing the agent's full-size V.

For one query head h of KV group g and the shared tokens' probabilities P [T_q, T]:

    P V_i = P (V0 + s a_v B_v) = P V0 + s (P a_v) B_v          (a_v: [T, r], B_v: [r, d])

so the agent's values cost T_q * T * r extra products instead of T * r * H_kv * d to build V_i.
Keys carry RoPE, which does not commute with the low-rank product per position, so keys are
either rebuilt pre-RoPE (``keys="lowrank"``: K0 + s a_k B_k, then rotated) or left as the shared
base (``keys="base"``, LRAgent's choice); ``benchmark/lab/precache_lab.py`` measures both.

``split_read_forward`` prefills an agent's new tokens (its turn suffix) on top of the store; its
naive twin is ``LoraForward.forward(past=store.view(agent))`` and the tests hold them equal.
"""

from __future__ import annotations

import math

import torch

from sglang_kvcmas_lab.correction.lora_forward import LoraForward
from sglang_kvcmas_lab.correction.precache_store import KEY_MODES, LowRankKVCache
from sglang_kvcmas_lab.models.reference_llama import ForwardOut, KVCache, rotate

__all__ = ["split_attend", "split_read_forward"]


def split_attend(q: torch.Tensor, q_pos: torch.Tensor, k_past: torch.Tensor,
                 v0: torch.Tensor, a_v: torch.Tensor | None, b_v: torch.Tensor | None,
                 scale: float, past_pos: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                 theta: float) -> torch.Tensor:
    """Attention of new tokens over [shared past ; themselves] with the split value read.

    q: [Tq, H, d] pre-RoPE; q_pos: [Tq]; k_past: [T, H_kv, d] pre-RoPE keys as read;
    v0: [T, H_kv, d] base values; a_v: [T, r] the agent's low-rank values (None: V0 only);
    b_v: [r, H_kv * d]; past_pos: [T]; k_new, v_new: [Tq, H_kv, d] (causal among themselves).
    Returns [Tq, H * d].
    """
    tq, num_heads, d = q.shape
    num_kv = v0.shape[1]
    group = num_heads // num_kv
    qr = rotate(q, q_pos, theta).view(tq, num_kv, group, d).permute(1, 2, 0, 3)  # [Hk, G, Tq, d]
    kp = rotate(k_past, past_pos, theta).permute(1, 2, 0)  # [Hk, d, T]
    kn = rotate(k_new, q_pos, theta).permute(1, 2, 0)  # [Hk, d, Tq]
    inv = 1.0 / math.sqrt(d)
    s_past = (qr @ kp[:, None]) * inv  # [Hk, G, Tq, T]
    s_new = (qr @ kn[:, None]) * inv  # [Hk, G, Tq, Tq]
    s_past = s_past.masked_fill(~(past_pos[None, :] <= q_pos[:, None]), float("-inf"))
    s_new = s_new.masked_fill(~(q_pos[None, :] <= q_pos[:, None]), float("-inf"))
    p = torch.softmax(torch.cat([s_past, s_new], dim=-1), dim=-1)
    p_past, p_new = p[..., : s_past.shape[-1]], p[..., s_past.shape[-1]:]
    out = p_past @ v0.permute(1, 0, 2)[:, None] + p_new @ v_new.permute(1, 0, 2)[:, None]
    if a_v is not None:
        pa = p_past @ a_v  # [Hk, G, Tq, r]
        out = out + scale * torch.einsum("kgtr,rkd->kgtd", pa, b_v.view(-1, num_kv, d))
    return out.permute(2, 0, 1, 3).reshape(tq, num_heads * d)


@torch.inference_mode()
def split_read_forward(lora: LoraForward, store: LowRankKVCache, agent: int, ids: torch.Tensor,
                       positions: torch.Tensor, *, keys: str = "lowrank") -> ForwardOut:
    """Prefill ``ids: [Tq]`` at ``positions`` as ``agent`` over ``store`` (split reads).

    Returns the new tokens' logits and their own (dense, exact for the agent) K/V.
    """
    if keys not in KEY_MODES:
        raise ValueError(f"keys must be one of {KEY_MODES}")
    spec, ref, ad = lora.spec, lora.ref, lora.adapters
    r = ad.rank
    h = ref.embed(ids)
    ks, vs = [], []
    for layer in range(spec.num_layers):
        _, q, k, v = lora.qkv(layer, h, agent)
        ks.append(k)
        vs.append(v)
        k_past = store.base.k[layer]
        ak = store.agent_a(layer, "k", agent, r)
        if keys == "lowrank" and ak is not None:
            f = ad.get(layer, "k_proj", agent)
            k_past = k_past + (f.scale * (ak @ f.b)).view_as(k_past)
        av = store.agent_a(layer, "v", agent, r)
        fv = ad.get(layer, "v_proj", agent) if av is not None else None
        attn = split_attend(q, positions, k_past, store.base.v[layer], av,
                            None if fv is None else fv.b, 0.0 if fv is None else fv.scale,
                            store.base.positions, k, v, spec.rope_theta)
        h = lora.finish_layer(layer, h, attn, agent)
    return ForwardOut(ref.logits(h), KVCache(ks, vs, positions), None)

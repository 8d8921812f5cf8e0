"""First-order hidden-state drift: every agent's K/V of the shared tokens, from one shared pass.

The store pass (``precache_pass``) runs once over the shared tokens with one set of weights (the
base, or the agents' centroid ``MEAN_AGENT``) and keeps its residual stream ``h``. Agent i's own
stream would be ``h + delta_i``, where ``delta_i`` is what agent i's adapters add on the way up:
o_proj and down_proj adapters add ``s (Z a) b`` to the residual every layer (Z: that layer's
attention output / MLP activation), and every adapter changes the inputs of the layers above.
This pass carries ``delta_i`` per agent alongside the shared pass, to first order, and reads
each agent's K/V off ``norm(h + delta_i)`` with the agent's own k/v adapter:

| ``attention`` | the agent's attention output at a shared token |
|---|---|
| ``"shared"`` | the shared pass's (only o_proj's adapter differs) |
| ``"values"`` | the shared pass's probabilities over the agent's values: P V_i |
| ``"own"`` | the agent's own queries and keys over its values (its whole attention) |

| ``mlp`` | the agent's MLP output |
|---|---|
| ``"shared"`` | the shared activation through the agent's down_proj (only down's adapter differs) |
| ``"adapters"`` | gate/up with the agent's adapter deltas on the shared input, then its down_proj |
| ``"own"`` | the agent's whole MLP on its own stream (with ``attention="own"``: exact) |

Costs per agent and shared token: k/v projections of the drifted stream; ``values`` adds the
P V_i product; ``own`` attention adds q, scores and softmax; ``adapters`` MLP adds the gate/up
deltas and one down projection; ``own`` MLP is the whole MLP. With
``attention="own", mlp="own"`` the pass is no sharing (a test holds it exact).

What each combination recovers is measured by ``benchmark/lab/precache_drift_study.py`` (figures
in ``docs/results.md``): only the direct o_proj/down_proj drift (``shared, shared``) helps;
partial attention or MLP corrections make the views worse than none (a drift that changes
attention but not the MLP's response to it overshoots). The remaining deviation is low rank,
though, which ``precache_delta`` uses instead.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from sglang_kvcmas_lab.correction.lora_forward import LoraForward
from sglang_kvcmas_lab.correction.lora_weights import MEAN_AGENT
from sglang_kvcmas_lab.correction.precache_store import LowRankKVCache
from sglang_kvcmas_lab.models.reference_llama import KVCache, keys_with_past, rotate

__all__ = ["ATTENTION_MODES", "MLP_MODES", "DriftPassOut", "drift_pass"]

ATTENTION_MODES = ("shared", "values", "own")
MLP_MODES = ("shared", "adapters", "own")


class DriftPassOut(NamedTuple):
    """store: the shared pass's LowRankKVCache of the new tokens (what ``store_pass`` returns);
    views: per agent, its drift-corrected pre-RoPE K/V of the new tokens [T tokens]."""

    store: LowRankKVCache
    views: list[KVCache]


def _probs(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, k_pos: torch.Tensor,
           theta: float) -> torch.Tensor:
    """Causal attention probabilities. q: [T, H, d]; k: [S, H_kv, d] pre-RoPE -> [H, T, S]."""
    t, num_heads, d = q.shape
    group = num_heads // k.shape[1]
    qr = rotate(q, q_pos, theta).transpose(0, 1)  # [H, T, d]
    kr = rotate(k, k_pos, theta).transpose(0, 1).repeat_interleave(group, 0)  # [H, S, d]
    s = (qr @ kr.transpose(1, 2)) / math.sqrt(d)
    s = s.masked_fill(~(k_pos[None, :] <= q_pos[:, None]), float("-inf"))
    return torch.softmax(s, dim=-1)


def _apply(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """p: [H, T, S]; v: [S, H_kv, d] -> [T, H * d]."""
    num_heads, t, _ = p.shape
    group = num_heads // v.shape[1]
    out = p @ v.transpose(0, 1).repeat_interleave(group, 0)  # [H, T, d]
    return out.transpose(0, 1).reshape(t, -1)


@torch.inference_mode()
def drift_pass(lora: LoraForward, ids: torch.Tensor, positions: torch.Tensor,
               past_shared: KVCache | None, past_agents: list[KVCache] | None, *,
               shared: int | None = MEAN_AGENT, attention: str = "values",
               mlp: str = "shared") -> DriftPassOut:
    """The shared pass over ``ids: [T]`` at ``positions: [T]`` as ``shared`` (None: base
    weights; MEAN_AGENT: the centroid) on top of ``past_shared`` (its own view of earlier
    tokens), carrying every agent's drift; ``past_agents[i]``: agent i's (drift-corrected) view
    of earlier tokens, read by ``attention="values" | "own"``."""
    if attention not in ATTENTION_MODES or mlp not in MLP_MODES:
        raise ValueError(f"attention in {ATTENTION_MODES}, mlp in {MLP_MODES}")
    spec, ref, ad = lora.spec, lora.ref, lora.adapters
    n_agents, theta = ad.num_agents, spec.rope_theta
    h = ref.embed(ids)
    delta = [torch.zeros_like(h) for _ in range(n_agents)]
    k0s, v0s, aks, avs = [], [], [], []
    agent_k = [[] for _ in range(n_agents)]
    agent_v = [[] for _ in range(n_agents)]
    for layer in range(spec.num_layers):
        blk = ref.decoder.layers[layer]
        att = blk.self_attn
        x = blk.input_layernorm(h)
        q = lora.proj(layer, "q_proj", att.q_proj, x, shared).view(-1, spec.num_heads,
                                                                      spec.head_dim)
        k = lora.proj(layer, "k_proj", att.k_proj, x, shared).view(-1, spec.num_kv_heads,
                                                                      spec.head_dim)
        v = lora.proj(layer, "v_proj", att.v_proj, x, shared).view_as(k)
        k0s.append(att.k_proj(x).view_as(k))
        v0s.append(att.v_proj(x).view_as(k))
        aks.append(x @ ad.stacked_a(layer, "k_proj") if ad.has(layer, "k_proj") else None)
        avs.append(x @ ad.stacked_a(layer, "v_proj") if ad.has(layer, "v_proj") else None)
        k_all, v_all, pos_all = keys_with_past(past_shared, layer, k, v, positions)
        p = _probs(q, positions, k_all, pos_all, theta)
        attn = _apply(p, v_all)
        h_mid = h + lora.proj(layer, "o_proj", att.o_proj, attn, shared)
        x2 = blk.post_attention_layernorm(h_mid)
        pre = blk.mlp.gate_proj(x2), blk.mlp.up_proj(x2)  # base-weight pre-activations
        act = _mlp_act(lora, layer, x2, shared, pre)
        h_new = h_mid + lora.proj(layer, "down_proj", blk.mlp.down_proj, act, shared)
        for i in range(n_agents):
            hi = h + delta[i]
            _, qi, ki, vi = lora.qkv(layer, hi, i)
            agent_k[i].append(ki)
            agent_v[i].append(vi)
            ka, va, _ = keys_with_past(past_agents[i] if past_agents else None, layer, ki, vi,
                                       positions)
            if attention == "shared":
                attn_i = attn
            elif attention == "values":
                attn_i = _apply(p, va)
            else:
                attn_i = ref.attend(qi, positions, ka, va, pos_all)
            hi_mid = hi + lora.proj(layer, "o_proj", att.o_proj, attn_i, i)
            if mlp == "shared":
                act_i = act
            elif mlp == "adapters":
                act_i = _mlp_act(lora, layer, x2, i, pre)
            else:
                hx = blk.post_attention_layernorm(hi_mid)
                act_i = _mlp_act(lora, layer, hx, i, (blk.mlp.gate_proj(hx), blk.mlp.up_proj(hx)))
            hi_new = hi_mid + lora.proj(layer, "down_proj", blk.mlp.down_proj, act_i, i)
            delta[i] = hi_new - h_new
        h = h_new
    store = LowRankKVCache(KVCache(k0s, v0s, positions), aks, avs)
    views = [KVCache(agent_k[i], agent_v[i], positions) for i in range(n_agents)]
    return DriftPassOut(store, views)


def _mlp_act(lora: LoraForward, layer: int, x: torch.Tensor, agent: int | None,
             pre: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """silu(gate) * up with ``agent``'s gate/up adapter deltas on ``x: [T, D]`` added to the
    base-weight pre-activations ``pre = (x W_gate, x W_up)`` (each [T, I])."""
    ad = lora.adapters
    gate, up = pre
    d_g, d_u = ad.delta(layer, "gate_proj", x, agent), ad.delta(layer, "up_proj", x, agent)
    gate = gate if d_g is None else gate + d_g
    up = up if d_u is None else up + d_u
    return F.silu(gate) * up

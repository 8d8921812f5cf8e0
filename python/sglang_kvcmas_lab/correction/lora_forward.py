"""The reference forward with one agent's LoRA adapter applied by explicit math.

Every projection is ``base(x) + scale * (x a) b`` for the agent's factors (``AdapterSet``), over
the base model's own modules (``RefLlama``'s pieces), so one loaded model serves every agent and
the adapter-free ("neutral") forward is the same code with ``agent=None``. The dense forward with
``agent=i`` is the no-sharing reference; it matches peft's own forward (see the tests).

``AgentModel`` binds an agent and exposes RefLlama's pieces, ``forward`` and ``greedy`` so the
shared lab harness (``sglang_kvcmas_bench.lab.reference``) can drive it unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sglang_kvcmas_lab.correction.lora_weights import AdapterSet
from sglang_kvcmas_lab.models.reference_llama import ForwardOut, KVCache, RefLlama, keys_with_past

__all__ = ["AgentModel", "LoraForward"]


class LoraForward:
    """Layer pieces and a whole forward of ``ref`` (plain, not peft-wrapped) under an adapter."""

    def __init__(self, ref: RefLlama, adapters: AdapterSet):
        if adapters.num_agents and len(adapters.factors) != ref.spec.num_layers:
            raise ValueError("adapter layers do not match the model")
        self.ref = ref
        self.adapters = adapters
        self.spec = ref.spec

    def proj(self, layer: int, target: str, module, x: torch.Tensor,
             agent: int | None) -> torch.Tensor:
        """module(x) plus the agent's LoRA delta on ``target``. x: [T, d_in] -> [T, d_out]."""
        y = module(x)
        d = self.adapters.delta(layer, target, x, agent)
        return y if d is None else y + d

    def qkv(self, layer: int, h: torch.Tensor, agent: int | None):
        """h: [T, D] -> (x [T, D] normed input, q [T, H, d], k_pre [T, H_kv, d], v [T, H_kv, d])."""
        s, blk = self.spec, self.ref.decoder.layers[layer]
        x = blk.input_layernorm(h)
        att = blk.self_attn
        q = self.proj(layer, "q_proj", att.q_proj, x, agent).view(-1, s.num_heads, s.head_dim)
        k = self.proj(layer, "k_proj", att.k_proj, x, agent).view(-1, s.num_kv_heads, s.head_dim)
        v = self.proj(layer, "v_proj", att.v_proj, x, agent).view(-1, s.num_kv_heads, s.head_dim)
        return x, q, k, v

    def finish_layer(self, layer: int, h: torch.Tensor, attn: torch.Tensor,
                     agent: int | None) -> torch.Tensor:
        """Residual + o_proj + MLP with the agent's adapter. h: [T, D]; attn: [T, H * d]."""
        blk = self.ref.decoder.layers[layer]
        h = h + self.proj(layer, "o_proj", blk.self_attn.o_proj, attn, agent)
        x = blk.post_attention_layernorm(h)
        mlp = blk.mlp
        gate = self.proj(layer, "gate_proj", mlp.gate_proj, x, agent)
        up = self.proj(layer, "up_proj", mlp.up_proj, x, agent)
        return h + self.proj(layer, "down_proj", mlp.down_proj, F.silu(gate) * up, agent)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor | None = None,
                past: KVCache | None = None, *, agent: int | None = None,
                return_hidden: bool = False) -> ForwardOut:
        """RefLlama.forward with ``agent``'s adapter (None: adapters off). ids: [T]."""
        if positions is None:
            start = int(past.positions.max()) + 1 if past is not None and len(past) else 0
            positions = torch.arange(start, start + ids.numel())
        h = self.ref.embed(ids)
        hidden = [h] if return_hidden else None
        ks, vs = [], []
        for layer in range(self.spec.num_layers):
            _, q, k, v = self.qkv(layer, h, agent)
            ks.append(k)
            vs.append(v)
            k_all, v_all, pos_all = keys_with_past(past, layer, k, v, positions)
            h = self.finish_layer(layer, h, self.ref.attend(q, positions, k_all, v_all, pos_all),
                                  agent)
            if hidden is not None:
                hidden.append(h)
        return ForwardOut(self.ref.logits(h), KVCache(ks, vs, positions), hidden)


class AgentModel:
    """``LoraForward`` bound to one agent, with RefLlama's ``forward`` / ``greedy`` signature."""

    def __init__(self, lora: LoraForward, agent: int | None):
        self.lora = lora
        self.agent = agent
        self.spec = lora.spec

    # RefLlama's layer pieces, with this agent's adapter (for harness code driving layers).
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lora.ref.embed(ids)

    def qkv(self, layer: int, h: torch.Tensor):
        return self.lora.qkv(layer, h, self.agent)[1:]

    def attend(self, q, q_pos, k_pre, v, k_pos) -> torch.Tensor:
        return self.lora.ref.attend(q, q_pos, k_pre, v, k_pos)

    def finish_layer(self, layer: int, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        return self.lora.finish_layer(layer, h, attn, self.agent)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lora.ref.logits(h)

    def forward(self, ids, positions=None, past=None, *, return_hidden=False) -> ForwardOut:
        return self.lora.forward(ids, positions, past, agent=self.agent,
                                 return_hidden=return_hidden)

    @torch.inference_mode()
    def greedy(self, past: KVCache, first_logits: torch.Tensor, n: int,
               stop: int | None = None) -> list[int]:
        """Greedy-decode ``n`` tokens (or until ``stop``) continuing ``past``."""
        out = [int(first_logits.argmax())]
        cache = past
        while len(out) < n and out[-1] != stop:
            step = self.forward(torch.tensor(out[-1:]), past=cache)
            cache = KVCache.concat([cache, step.kv])
            out.append(int(step.logits[-1].argmax()))
        return out

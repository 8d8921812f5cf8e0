"""A reference forward for Llama-family models whose KV cache is explicit and position-aware.

The labs need what a serving engine hides: per-layer **pre-RoPE** keys and values, the positions
at which a cache is read (so a segment computed at one offset can be read at another), layer-by-
layer control (selective recompute, per-layer corrections) and the hidden states. This module
runs a Hugging Face ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` with its own modules (so a peft
LoRA wrapper on ``q_proj`` etc. still applies) but does attention itself:

- the cache stores pre-RoPE keys plus the position of every token; RoPE is applied when attention
  reads the cache, so re-positioning a cache is just giving it other positions (RoPE rotations
  compose: rotating a key computed at p to p + δ equals computing it at p + δ, at layer 0 exactly);
- the mask is causal *by position*: a query at position p sees every key at position <= p. This
  lets a forward recompute an arbitrary subset of a segment's tokens in place (CacheBlend-style)
  over a cache that holds the rest.

Batch of one sequence; shapes below omit the batch. It is a measuring instrument, not a server:
clarity and exactness come first, and it matches the HF forward (see test/lab/models).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from sglang_kvcmas.attention.rope import rotate_halves

__all__ = ["ForwardOut", "KVCache", "ModelSpec", "RefLlama", "keys_with_past"]


@dataclass(frozen=True)
class ModelSpec:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_eps: float
    vocab_size: int

    @classmethod
    def from_hf_config(cls, config) -> ModelSpec:
        rope = getattr(config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        if rope.get("rope_type", "default") != "default":
            raise NotImplementedError(f"rope_type {rope.get('rope_type')!r} is not supported")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=head_dim,
            rope_theta=float(theta),
            rms_eps=float(config.rms_norm_eps),
            vocab_size=config.vocab_size,
        )

    def kv_bytes_per_token(self, dtype: torch.dtype = torch.float32) -> int:
        """Bytes of K and V over all layers for one token (what a serving pool holds)."""
        elem = torch.tensor([], dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem


@dataclass
class KVCache:
    """Per-layer pre-RoPE keys and values of a token sequence, with the positions they are read at.

    Attributes:
        k: num_layers x [num_tokens, num_kv_heads, head_dim], pre-RoPE.
        v: num_layers x [num_tokens, num_kv_heads, head_dim].
        positions: [num_tokens] int64, the positions RoPE uses when attention reads these keys.
    """

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    positions: torch.Tensor

    def __len__(self) -> int:
        return int(self.positions.numel())

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @classmethod
    def empty(cls, spec: ModelSpec, dtype: torch.dtype, device="cpu") -> KVCache:
        z = torch.empty(0, spec.num_kv_heads, spec.head_dim, dtype=dtype, device=device)
        return cls([z] * spec.num_layers, [z] * spec.num_layers,
                   torch.empty(0, dtype=torch.long, device=device))

    @classmethod
    def concat(cls, caches: list[KVCache]) -> KVCache:
        caches = [c for c in caches if len(c)] or caches[:1]
        n = caches[0].num_layers
        return cls(
            [torch.cat([c.k[i] for c in caches]) for i in range(n)],
            [torch.cat([c.v[i] for c in caches]) for i in range(n)],
            torch.cat([c.positions for c in caches]),
        )

    def slice(self, start: int, end: int) -> KVCache:
        return KVCache([k[start:end] for k in self.k], [v[start:end] for v in self.v],
                       self.positions[start:end])

    def with_positions(self, positions: torch.Tensor) -> KVCache:
        """The same K/V read at other positions (a RoPE re-positioning; no tensor is copied)."""
        assert positions.shape == self.positions.shape, (positions.shape, self.positions.shape)
        return KVCache(self.k, self.v, positions)

    def shifted(self, delta: int) -> KVCache:
        return self.with_positions(self.positions + delta)

    def clone(self) -> KVCache:
        return KVCache([k.clone() for k in self.k], [v.clone() for v in self.v],
                       self.positions.clone())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))


def keys_with_past(
    past: KVCache | None,
    layer: int,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What one layer's attention reads: ``past``'s K/V (if any) followed by the new tokens'.

    k, v: [T, H_kv, d] of the new tokens (pre-RoPE k); positions: [T].
    Returns (k_all, v_all, pos_all) over len(past) + T tokens.
    """
    if past is None or not len(past):
        return k, v, positions
    return (torch.cat([past.k[layer], k]), torch.cat([past.v[layer], v]),
            torch.cat([past.positions, positions]))


class ForwardOut(NamedTuple):
    """logits: [num_new, vocab]; kv: cache of the new tokens only; hidden: per-layer inputs
    ([num_new, hidden_size] x (num_layers + 1), the last being the final norm's input), or None."""

    logits: torch.Tensor
    kv: KVCache
    hidden: list[torch.Tensor] | None


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Apply RoPE (HF "rotate_half" layout) to ``x: [T, H, d]`` at ``positions: [T]``.

    cos/sin are computed in float64 and cast, so re-rotation identities hold to rounding.
    """
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64, device=x.device) / d))
    ang = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    cos, sin = ang.cos().to(x.dtype)[:, None, :], ang.sin().to(x.dtype)[:, None, :]
    return rotate_halves(x, cos, sin)


class RefLlama:
    """Reference forward over a HF Llama/Qwen2 causal LM (optionally peft-wrapped)."""

    def __init__(self, hf_model):
        self.hf = hf_model.eval()
        base = hf_model
        # peft's PeftModel forwards attribute lookups (``lm_head``, ``model``) to the wrapped
        # model, so the loop below would stop at the PeftModel itself: unwrap it explicitly.
        if hasattr(base, "get_base_model"):
            base = base.get_base_model()
        # peft's PeftModel -> LoraModel -> LlamaForCausalLM; plain HF model otherwise.
        while not hasattr(base, "lm_head") and hasattr(base, "model"):
            base = base.model
        if hasattr(base, "base_model") and not hasattr(base, "lm_head"):
            base = base.base_model
        self.causal_lm = base
        self.decoder = base.model
        self.spec = ModelSpec.from_hf_config(base.config)
        self.dtype = next(base.parameters()).dtype

    @classmethod
    def from_pretrained(cls, folder: str | Path, dtype: torch.dtype = torch.float32) -> RefLlama:
        from transformers import AutoModelForCausalLM

        return cls(AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype))

    # ---- pieces -------------------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: [T] int64 -> [T, hidden_size]."""
        return self.decoder.embed_tokens(ids)

    def qkv(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer input h: [T, D] -> q [T, H, d], k_pre [T, H_kv, d], v [T, H_kv, d] (no RoPE)."""
        s, blk = self.spec, self.decoder.layers[layer]
        x = blk.input_layernorm(h)
        att = blk.self_attn
        q = att.q_proj(x).view(-1, s.num_heads, s.head_dim)
        k = att.k_proj(x).view(-1, s.num_kv_heads, s.head_dim)
        v = att.v_proj(x).view(-1, s.num_kv_heads, s.head_dim)
        return q, k, v

    def attend(
        self,
        q: torch.Tensor,
        q_pos: torch.Tensor,
        k_pre: torch.Tensor,
        v: torch.Tensor,
        k_pos: torch.Tensor,
    ) -> torch.Tensor:
        """Causal-by-position attention. q: [T, H, d] pre-RoPE; k_pre, v: [S, H_kv, d];
        q_pos: [T]; k_pos: [S]. Returns [T, H * d]."""
        s = self.spec
        qr = rotate(q, q_pos, s.rope_theta).transpose(0, 1)[None]
        kr = rotate(k_pre, k_pos, s.rope_theta).transpose(0, 1)[None]
        vv = v.transpose(0, 1)[None]
        mask = k_pos[None, :] <= q_pos[:, None]
        out = F.scaled_dot_product_attention(qr, kr, vv, attn_mask=mask, enable_gqa=True)
        return out[0].transpose(0, 1).reshape(q.shape[0], s.num_heads * s.head_dim)

    def finish_layer(self, layer: int, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual + o_proj + MLP. h: layer input [T, D]; attn: [T, H * d] -> [T, D]."""
        blk = self.decoder.layers[layer]
        h = h + blk.self_attn.o_proj(attn)
        return h + blk.mlp(blk.post_attention_layernorm(h))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final hidden state [T, D] (before the final norm) -> logits [T, vocab]."""
        return self.causal_lm.lm_head(self.decoder.norm(h))

    # ---- whole forward -------------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        past: KVCache | None = None,
        *,
        return_hidden: bool = False,
    ) -> ForwardOut:
        """Prefill ``ids: [T]`` at ``positions: [T]`` on top of ``past``.

        positions default to ``len(past) .. len(past) + T - 1`` continuing past's last position.
        Each new token sees every past key at a position <= its own, and the new tokens causally.
        """
        if positions is None:
            start = int(past.positions.max()) + 1 if past is not None and len(past) else 0
            positions = torch.arange(start, start + ids.numel(), device=ids.device)
        h = self.embed(ids)
        hidden = [h] if return_hidden else None
        ks, vs = [], []
        for layer in range(self.spec.num_layers):
            q, k, v = self.qkv(layer, h)
            ks.append(k)
            vs.append(v)
            k_all, v_all, pos_all = keys_with_past(past, layer, k, v, positions)
            h = self.finish_layer(layer, h, self.attend(q, positions, k_all, v_all, pos_all))
            if hidden is not None:
                hidden.append(h)
        return ForwardOut(self.logits(h), KVCache(ks, vs, positions), hidden)

    @torch.inference_mode()
    def greedy(self, past: KVCache, first_logits: torch.Tensor, n: int) -> list[int]:
        """Greedy-decode ``n`` tokens continuing ``past``; first_logits: [vocab] of the last token."""
        out = [int(first_logits.argmax())]
        cache = past
        for _ in range(n - 1):
            step = self.forward(torch.tensor(out[-1:]), past=cache)
            cache = KVCache.concat([cache, step.kv])
            out.append(int(step.logits[-1].argmax()))
        return out

"""Attention that reads shared-segment KV through per-agent low-rank deltas.

Modules (one noun each):
  ``batch``            frozen descriptions of a batch: requests, shared spans, delta factors
  ``rope``             neox RoPE helpers (rotations compose: the re-positioning algebra)
  ``reference``        the torch reference (oracle, CPU serving path); the algebra is its docstring
  ``plan``             host-side tiling and factor packing for the kernels
  ``triton_delta``     Triton extend/decode kernels (imports triton)
  ``flashinfer_delta`` FlashInfer variant wrapper (imports flashinfer lazily, GPU only)

Importing this package needs only torch; the kernel modules are imported by name.
"""

from sglang_kvcmas.attention.batch import DeltaRequest, LowRankDelta, SharedSpan, SpanFactors
from sglang_kvcmas.attention.plan import (
    DeltaPlan,
    PackedFactors,
    pack_delta_factors,
    plan_delta_batch,
)
from sglang_kvcmas.attention.reference import (
    causal_attention,
    delta_attention,
    delta_decode_attention,
    lora_value_read,
    plain_attention,
    reader_kv,
)
from sglang_kvcmas.attention.rope import apply_rope, rope_inv_freq

__all__ = [
    "DeltaPlan",
    "DeltaRequest",
    "LowRankDelta",
    "PackedFactors",
    "SharedSpan",
    "SpanFactors",
    "apply_rope",
    "causal_attention",
    "delta_attention",
    "delta_decode_attention",
    "lora_value_read",
    "pack_delta_factors",
    "plain_attention",
    "plan_delta_batch",
    "reader_kv",
    "rope_inv_freq",
]

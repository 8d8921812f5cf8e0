"""Attention that reads shared-segment KV through per-agent low-rank deltas (lab).

Modules (one noun each):
  ``reference``        the torch reference (the oracle); the algebra is its docstring
  ``torch_delta``      the same read planned once per batch (CPU)
  ``flashinfer_delta`` FlashInfer variant wrapper (imports flashinfer lazily, GPU only)

The kernels' batch types (``sglang_kvcmas.attention.delta_batch``), their planning
(``delta_plan``) and the Triton kernels (``triton_delta``) live in the server package, whose GPU
decode runs them; they are re-exported here for the lab.

Importing this package needs only torch; the kernel modules are imported by name. RoPE comes from
the server's one helper, ``sglang_kvcmas.attention.rope``.
"""

from sglang_kvcmas.attention.delta_batch import DeltaRequest, LowRankDelta, SharedSpan, SpanFactors
from sglang_kvcmas.attention.delta_plan import (
    DeltaPlan,
    PackedFactors,
    pack_delta_factors,
    plan_delta_batch,
)
from sglang_kvcmas_lab.attention.reference import (
    causal_attention,
    delta_attention,
    delta_decode_attention,
    lora_value_read,
    plain_attention,
    reader_kv,
)
from sglang_kvcmas.attention.rope import apply_rope, rope_inv_freq
from sglang_kvcmas_lab.attention.torch_delta import (
    TorchDeltaPlan,
    plan_torch_delta,
    run_torch_delta,
)

__all__ = [
    "DeltaPlan",
    "DeltaRequest",
    "LowRankDelta",
    "PackedFactors",
    "SharedSpan",
    "SpanFactors",
    "TorchDeltaPlan",
    "apply_rope",
    "causal_attention",
    "delta_attention",
    "delta_decode_attention",
    "lora_value_read",
    "pack_delta_factors",
    "plain_attention",
    "plan_delta_batch",
    "plan_torch_delta",
    "reader_kv",
    "rope_inv_freq",
    "run_torch_delta",
]

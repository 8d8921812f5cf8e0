// sglang-kvcmas: FlashInfer (FA2 JIT) attention variant that reads shared-span keys as a reader
// agent sees them. Rendered into FlashInfer's batch prefill customize template as `variant_decl`
// by python/sglang_kvcmas/attention/flashinfer_delta.py; the math is the torch reference in
// python/sglang_kvcmas/attention/reference.py:
//
//   key read of token t in a shared span = R(shift_t) * k_base(t) + R(p_t) * (U_t C^T)
//
// where k_base is the post-RoPE key in the paged pool, shift_t = reader position - owner position,
// p_t = reader position = request-local kv index, U_t: [r] and C: [head_dim, r] the pre-RoPE
// low-rank deviation (neox RoPE: dimension i pairs with i + head_dim/2).
//
// NOTE: FlashInfer 0.7.2 declares REGISTER_KEY_TRANSFORM but its FA2 kernels never call it; the only
// per-key hook is LogitsTransform, which sees the scalar logit, not the key tile. So this variant
// recomputes the logit of a shared-span token from q, the pool and the factors: O(head_dim * r) per
// (query head, key) pair, in CUDA cores. Exact tokens (span < 0) keep FlashInfer's tensor-core
// logit untouched. Values are read as stored (no hook can add P*U_v); value deltas need the Triton
// kernel. See kernels/README.md.
//
// Additional tensors (params.<name>):
//   kvcmas_token_offset [batch + 1] int32   per-request offset into the per-token arrays
//   kvcmas_token_span   [total_kv]  int32   global span id (row of kvcmas_k_c) or -1
//   kvcmas_token_urow   [total_kv]  int32   row of kvcmas_k_u
//   kvcmas_token_shift  [total_kv]  int32   reader position - owner position
//   kvcmas_k_u          [rows, num_kv_heads, block_r] float32
//   kvcmas_k_c          [spans, num_kv_heads, head_dim, block_r] float32
//   kvcmas_inv_freq     [head_dim / 2] float32
// Additional scalars: sm_scale (double), kvcmas_block_r (int64), kvcmas_num_kv_heads (int64).

struct KvcmasDeltaKeyAttention : AttentionVariantBase {
  static constexpr bool use_softmax = true;

  uint32_t window_left, qo_len, kv_len;
  float sm_scale_log2;

  template <typename Params>
  __device__ __host__ KvcmasDeltaKeyAttention(const Params& params, uint32_t batch_idx,
                                              uint8_t* smem_ptr) {
    qo_len = params.get_qo_len(batch_idx);
    kv_len = params.get_kv_len(batch_idx);
    window_left = kv_len;
    sm_scale_log2 = float(params.sm_scale) * math::log2e;
  }

  REGISTER_LOGITS_TRANSFORM(params, logits, batch_idx, qo_idx, kv_idx, qo_head_idx, kv_head_idx, {
    // Padding rows of a query tile arrive with qo_idx >= qo_len; their logits are discarded, and
    // their q row may lie past the end of q, so it must not be read.
    if (qo_idx >= qo_len || kv_idx >= kv_len) {
      return logits;
    }
    const int32_t token = params.kvcmas_token_offset[batch_idx] + int32_t(kv_idx);
    const int32_t span = params.kvcmas_token_span[token];
    if (span < 0) {
      return logits;
    }
    constexpr uint32_t HALF = HEAD_DIM_QK / 2;
    const int64_t block_r = params.kvcmas_block_r;
    const int64_t heads = params.kvcmas_num_kv_heads;
    const float shift = float(params.kvcmas_token_shift[token]);
    const float pos = float(kv_idx);
    const float* u = params.kvcmas_k_u +
                     (int64_t(params.kvcmas_token_urow[token]) * heads + kv_head_idx) * block_r;
    const float* c = params.kvcmas_k_c + (int64_t(span) * heads + kv_head_idx) * HEAD_DIM_QK * block_r;
    // The query row: request-local qo_idx in a ragged [total_q, num_qo_heads, head_dim] tensor.
    const auto* q = params.q + (int64_t(params.q_indptr[batch_idx]) + qo_idx) * params.q_stride_n +
                    int64_t(qo_head_idx) * params.q_stride_h;
    uint32_t page_iter, entry;
    params.paged_kv.page_size.divmod(kv_idx, page_iter, entry);
    const auto* k = params.paged_kv.k_data +
                    params.paged_kv.get_elem_offset(
                        params.paged_kv.indices[params.paged_kv.indptr[batch_idx] + page_iter],
                        kv_head_idx, entry, 0);
    float acc = 0.f;
    for (uint32_t i = 0; i < HALF; ++i) {
      const float freq = params.kvcmas_inv_freq[i];
      float s_sin, s_cos, p_sin, p_cos;
      __sincosf(shift * freq, &s_sin, &s_cos);
      __sincosf(pos * freq, &p_sin, &p_cos);
      const float kb_lo = float(k[i]), kb_hi = float(k[i + HALF]);
      float d_lo = 0.f, d_hi = 0.f;
      for (int64_t j = 0; j < block_r; ++j) {
        d_lo += c[i * block_r + j] * u[j];
        d_hi += c[(i + HALF) * block_r + j] * u[j];
      }
      const float k_lo = kb_lo * s_cos - kb_hi * s_sin + d_lo * p_cos - d_hi * p_sin;
      const float k_hi = kb_hi * s_cos + kb_lo * s_sin + d_hi * p_cos + d_lo * p_sin;
      acc += float(q[i]) * k_lo + float(q[i + HALF]) * k_hi;
    }
    return acc;
  })
};

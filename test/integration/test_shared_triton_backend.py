"""SGLang's real Triton attention backend as a sharing dispatcher, run on CPU in Triton's
interpreter: plain batches go through SGLang's Triton kernels and agree with the torch reference
(``kvcmas_delta``); batches that read borrowed KV take the delta path and equal the reference bit
for bit (and differ from what the Triton kernels alone would read); the delta kernels' extend and
decode of the same batches (the GPU path) agree with the torch path. An owners' probe batch (head
mass, nothing borrowed) runs on SGLang's Triton kernels, the delta path never asked, and records
the head mass the torch path records; a reader's probe beside the delta kernels does too.

SGLang's Triton backend runs on CPU tensors under ``TRITON_INTERPRET=1`` once a server-args
context is installed (float32 or float16; the interpreter's bf16 ``tl.dot`` is wrong). Installing
that context is process-global, so the case runs in a subprocess (this file's ``__main__``).
FlashInfer's kernels are CUDA only: its backend is covered by the dispatch tests with a stand-in.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest

HQ, HKV, D, POOL, MAX_REQS, CTX = 4, 2, 64, 64, 4, 32
LAYERS = 3  # layer 2 records head mass (spans.is_probe_layer)


def test_triton_backend_dispatches_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and "TRITON-DISPATCH OK" in out.stdout, (
        out.stdout[-3000:] + out.stderr[-3000:])


def _case() -> None:  # noqa: PLR0915 (one scenario, read top to bottom)
    import torch
    from sglang.srt.runtime_context import get_context, get_parallel

    get_context().override_server_args(device="cpu", attention_backend="triton").install()
    get_parallel().override_permanently(attn_dcp_rank=0)

    from sglang.srt.configs.model_config import AttentionArch
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
    from transformers import LlamaConfig

    from sglang_kvcmas.attention.rope import ShiftRope
    from sglang_kvcmas.attention.spans import BatchRow, HeadMassProbe, RowSpans, SharedSpan
    from sglang_kvcmas.integration import delta_attention_backend
    from sglang_kvcmas.integration.batch_rows import TaggedRids
    from sglang_kvcmas.integration.delta_attention_backend import DeltaAttnBackend
    from sglang_kvcmas.integration.dispatch_route import Route
    from sglang_kvcmas.integration.shared_backends import as_shared

    # The model's rotary as plain theta RoPE (its derivation from SGLang's modules is tested in
    # test_rope_shift.py; SGLang's CPU rotary needs its CPU engine, which this case does not run).
    rope = ShiftRope.full(1.0 / 10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    delta_attention_backend.shift_rope_for_runner = lambda runner: rope
    torch.manual_seed(0)

    class ModelConfig:
        attention_arch = AttentionArch.MHA
        hf_config = LlamaConfig(num_attention_heads=HQ, num_key_value_heads=HKV,
                                hidden_size=HQ * D, num_hidden_layers=LAYERS)
        v_head_dim = swa_v_head_dim = head_dim = D
        context_len = CTX
        is_encoder_decoder = False
        linear_attn_registry_result = None
        model_path = "tiny-llama"

        def get_max_num_attention_heads(self):
            return HQ

        def get_num_kv_heads(self, tp_size, dcp_size=1):
            return HKV

    req_to_token = ReqToTokenPool(size=MAX_REQS, max_context_len=CTX, device="cpu",
                                  enable_memory_saver=False)
    kv = MHATokenToKVPool(size=POOL, page_size=1, dtype=torch.float32, head_num=HKV, head_dim=D,
                          layer_num=LAYERS, device="cpu", enable_memory_saver=False,
                          enable_alt_stream=False)
    alloc = TokenToKVPoolAllocator(size=POOL, dtype=torch.float32, device="cpu", kvcache=kv,
                                   need_sort=False)
    translator = KVIndexTranslator(req_to_token=req_to_token.req_to_token,
                                   token_to_kv_pool_allocator=alloc, token_to_kv_pool=kv,
                                   page_size=1, device="cpu")
    runner = types.SimpleNamespace(
        req_to_token_pool=req_to_token, token_to_kv_pool=kv, token_to_kv_pool_allocator=alloc,
        kv_index_translator=translator, sliding_window_size=None, page_size=1,
        model_config=ModelConfig(), kv_cache_dtype=torch.float32, device="cpu", gpu_id=0,
        is_draft_worker=False, use_mla_backend=False, model=None,
        decode_num_tokens_per_req=lambda **kw: 1)
    shared = as_shared(TritonAttnBackend(runner), runner, "triton")
    plain = TritonAttnBackend(runner)  # what the kernels alone read
    reference = DeltaAttnBackend(runner)  # kvcmas_delta: torch_native + the delta path
    layer, probe_layer = (RadixAttention(num_heads=HQ, head_dim=D, scaling=D ** -0.5,
                                         num_kv_heads=HKV, layer_id=i) for i in (0, 2))

    reqs, lens, prefix = [1, 3], [11, 7], [8, 4]
    slots = alloc.alloc(sum(lens) + 2)
    slots = slots[torch.randperm(slots.numel())]  # scattered, as in a used pool
    rows_slots = [slots[:lens[0]], slots[lens[0]:sum(lens)]]
    for r, s in zip(reqs, rows_slots):
        req_to_token.req_to_token[r, : s.numel()] = s.to(torch.int32)
    for i in range(LAYERS):
        k_i, v_i = kv.get_kv_buffer(i)
        k_i[slots] = torch.randn(slots.numel(), HKV, D)
        v_i[slots] = torch.randn(slots.numel(), HKV, D)
    k_pool, v_pool = kv.get_kv_buffer(0)
    # Row 0 reads keys 2..6 of its prefix from another agent, 3 positions earlier there.
    reader = BatchRow(RowSpans.of_reads("r0", (SharedSpan(2, 5, 3),)))

    def batch(mode, seq, out_loc, rows, pre=None):
        seq_t = torch.tensor(seq, dtype=torch.int64)
        kw = {}
        if pre is not None:
            ext = [s - p for s, p in zip(seq, pre)]
            kw = dict(extend_prefix_lens=torch.tensor(pre, dtype=torch.int32),
                      extend_prefix_lens_cpu=list(pre),
                      extend_seq_lens=torch.tensor(ext, dtype=torch.int32),
                      extend_seq_lens_cpu=ext, extend_num_tokens=sum(ext))
        fb = ForwardBatch(forward_mode=mode, batch_size=len(seq),
                          input_ids=torch.zeros(out_loc.numel(), dtype=torch.int64),
                          req_pool_indices=torch.tensor(reqs, dtype=torch.int64), seq_lens=seq_t,
                          out_cache_loc=out_loc, seq_lens_sum=sum(seq), seq_lens_cpu=seq_t.clone(),
                          **kw)
        translator.own_plan(fb).bind(fb, translator)
        fb.rids = ["r0", "r1"]
        if rows is not None:  # what batch_rows.attach_rows does
            fb.rids = TaggedRids(fb.rids)
            fb.rids.rows = rows
        return fb

    def run(backend, fb, q, k, v, at=layer):
        backend.init_forward_metadata(fb)
        return backend.forward(q, k, v, at, fb).view(q.shape[0], HQ, D)

    n_new = sum(lens) - sum(prefix)
    ext_loc = torch.cat([s[p:] for s, p in zip(rows_slots, prefix)])
    q, k, v = (torch.randn(n_new, HQ * D), k_pool[ext_loc].clone(), v_pool[ext_loc].clone())
    dec_loc = slots[sum(lens):]
    for i, r in enumerate(reqs):
        req_to_token.req_to_token[r, lens[i]] = int(dec_loc[i])
    qd, kd, vd = torch.randn(2, HQ * D), k_pool[dec_loc].clone(), v_pool[dec_loc].clone()
    extend, decode = ForwardMode.EXTEND, ForwardMode.DECODE
    dec_lens = [n + 1 for n in lens]
    checks = {}
    for name, rows in (("plain", None), ("reader", (reader, None))):
        ext_shared = run(shared, batch(extend, lens, ext_loc, rows, prefix), q, k, v)
        ext_ref = run(reference, batch(extend, lens, ext_loc, rows, prefix), q, k, v)
        dec_shared = run(shared, batch(decode, dec_lens, dec_loc, rows), qd, kd, vd)
        dec_ref = run(reference, batch(decode, dec_lens, dec_loc, rows), qd, kd, vd)
        checks[name] = ((ext_shared - ext_ref).abs().max().item(),
                        (dec_shared - dec_ref).abs().max().item())
        if name == "reader":
            dec_plain = run(plain, batch(decode, dec_lens, dec_loc, None), qd, kd, vd)
            checks["shift_matters"] = (dec_plain - dec_ref)[0].abs().max().item()
            checks["reader_row_1_plain"] = (dec_plain - dec_ref)[1].abs().max().item()
    # An owners' probe batch at a probe layer: SGLang's Triton kernels attend (the delta path is
    # never asked), the head mass is read beside them from the pool.
    k2_pool, v2_pool = kv.get_kv_buffer(2)
    k2, v2 = k2_pool[ext_loc].clone(), v2_pool[ext_loc].clone()

    def probed(spans=None):  # fresh probes: row 0's head rows 1..4, row 1's 0..1
        return (BatchRow(spans, HeadMassProbe.for_row(1, 5, lens[0])),
                BatchRow(probe=HeadMassProbe.for_row(0, 2, lens[1])))

    asked = []
    real_delta = shared.kvcmas_delta
    shared.kvcmas_delta = types.SimpleNamespace(
        token_to_kv_pool=real_delta.token_to_kv_pool, delta_kernel=False,
        req_to_token_pool=real_delta.req_to_token_pool,
        init_forward_metadata=lambda fb: asked.append("init"),
        forward=lambda *a: asked.append("forward"))
    stock_rows, ref_rows = probed(), probed()
    fb = batch(extend, lens, ext_loc, stock_rows, prefix)
    ext_stock = run(shared, fb, q, k2, v2, probe_layer)
    shared.kvcmas_delta = real_delta
    assert asked == [] and fb.rids.cache["route"] == Route("stock", "probe")
    ext_plain = run(plain, batch(extend, lens, ext_loc, None, prefix), q, k2, v2, probe_layer)
    ext_ref = run(reference, batch(extend, lens, ext_loc, ref_rows, prefix), q, k2, v2,
                  probe_layer)
    checks["probe_out_is_triton"] = (ext_stock - ext_plain).abs().max().item()
    checks["probe_out_vs_ref"] = (ext_stock - ext_ref).abs().max().item()
    checks["probe_mass"] = max((s.probe.sums - r.probe.sums).abs().max().item()
                               for s, r in zip(stock_rows, ref_rows))
    assert all(torch.equal(s.probe.counts, r.probe.counts) and r.probe.counts[-1] == 1
               for s, r in zip(stock_rows, ref_rows))
    # The GPU paths: the delta kernels for the whole batch (here in the interpreter).
    shared.kvcmas_delta.delta_kernel = True
    # A reader that also records head mass: the kernels attend, the mass is read beside them.
    kernel_rows, ref_rows = probed(reader.spans), probed(reader.spans)
    fb = batch(extend, lens, ext_loc, kernel_rows, prefix)
    ext_kernel = run(shared, fb, q, k2, v2, probe_layer)
    assert fb.rids.cache["route"] == Route("kernel", "reader")
    ext_ref = run(reference, batch(extend, lens, ext_loc, ref_rows, prefix), q, k2, v2,
                  probe_layer)
    checks["kernel_probe_out"] = (ext_kernel - ext_ref).abs().max().item()
    checks["kernel_probe_mass"] = max((s.probe.sums - r.probe.sums).abs().max().item()
                                      for s, r in zip(kernel_rows, ref_rows))
    rows = (reader, None)
    ext_kernel = run(shared, batch(extend, lens, ext_loc, rows, prefix), q, k, v)
    assert any(key[0] == "kernel" for key in shared.kvcmas_delta._groups)
    ext_ref = run(reference, batch(extend, lens, ext_loc, rows, prefix), q, k, v)
    dec_kernel = run(shared, batch(decode, dec_lens, dec_loc, rows), qd, kd, vd)
    assert any(key[0] == "kernel" for key in shared.kvcmas_delta._groups)
    dec_ref = run(reference, batch(decode, dec_lens, dec_loc, rows), qd, kd, vd)
    checks["kernel_extend"] = (ext_kernel - ext_ref).abs().max().item()
    checks["kernel_decode"] = (dec_kernel - dec_ref).abs().max().item()
    print(checks)
    assert max(checks["plain"]) < 1e-5, checks  # SGLang's Triton kernels vs torch
    assert checks["reader"] == (0.0, 0.0), checks  # the delta path itself, bit for bit
    assert checks["shift_matters"] > 1e-3 and checks["reader_row_1_plain"] < 1e-5, checks
    assert checks["kernel_extend"] < 1e-5 and checks["kernel_decode"] < 1e-5, checks
    assert checks["probe_out_is_triton"] == 0.0 and checks["probe_out_vs_ref"] < 1e-5, checks
    assert checks["probe_mass"] < 1e-6, checks  # the same mass from the same q and keys
    assert checks["kernel_probe_out"] < 1e-5 and checks["kernel_probe_mass"] < 1e-6, checks
    print("TRITON-DISPATCH OK")


if __name__ == "__main__":
    _case()
else:
    pytestmark = pytest.mark.slow

"""The serving read path: RoPE, the span type and row metadata, and the tensor work of reading
borrowed KV re-positioned (torch, and Triton on GPU; the SGLang backend in ``integration/`` calls
these).

Modules (one noun each):
  ``rope``           RoPE helpers and ``ShiftRope`` (neox or GPT-J, partial rotary; rotations
                     compose: the re-positioning algebra)
  ``spans``          ``SharedSpan``, a row's borrowed spans, recomputed tokens, head-mass probe
  ``span_reads``     keys re-positioned by span (the reference), head mass on the agent head,
                     the pairs factored leaves are fitted on
  ``probe_reads``    a batch's head mass recorded beside any attention path (the pool's keys
                     for rows that read nothing borrowed; on CUDA ``triton_head_mass``)
  ``shifted_query``  decode that rotates the query per shift instead of every borrowed key, one
                     row at a time (the reference for decode)
  ``batched_decode`` the same decode for a whole batch in a few tensor ops per layer (the CPU path)
  ``deviation_factors``   factored leaves: a reader's recomputed tokens kept as low-rank factors
                     of their deviation from the owner's KV, added to the keys and values
                     read (and the naive reference of such reads)
  ``kernel_reads``   the GPU path: a batch planned once per forward, one delta-kernel launch per
                     layer, factored leaves placed in the kernels' factors
  ``triton_delta``   the Triton delta kernels' launchers (``@triton.jit`` code in
                     ``triton_delta_kernels``, batch types in ``delta_batch``, tiling in
                     ``delta_plan``)
"""

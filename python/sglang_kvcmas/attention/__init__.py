"""The serving read path: RoPE, the span type and row metadata, and the tensor work of reading
borrowed KV re-positioned (torch only; the SGLang backend in ``integration/`` calls these).

Modules (one noun each):
  ``rope``           RoPE helpers and ``ShiftRope`` (neox or GPT-J, partial rotary; rotations
                     compose: the re-positioning algebra)
  ``spans``          ``SharedSpan``, a row's borrowed spans, recomputed tokens, head-mass probe
  ``span_reads``     keys re-positioned by span (the reference), head mass on the agent head
  ``shifted_query``  decode that rotates the query per shift instead of every borrowed key
  ``lowrank``        a reader's low-rank correction (factors per layer and KV head) and its
                     online estimator from the tokens it recomputes
  ``corrected_reads`` reading borrowed KV through the correction: the naive reference, extend's
                     explicit rows, decode on the query and output side
"""

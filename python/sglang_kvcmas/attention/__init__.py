"""The serving read path: RoPE, the span type and row metadata, and the tensor work of reading
borrowed KV re-positioned (torch only; the SGLang backend in ``integration/`` calls these).

Modules (one noun each):
  ``rope``           RoPE helpers and ``ShiftRope`` (neox or GPT-J, partial rotary; rotations
                     compose: the re-positioning algebra)
  ``spans``          ``SharedSpan``, a row's borrowed spans, recomputed tokens, head-mass probe
  ``span_reads``     keys re-positioned by span (the reference), head mass on the agent head,
                     the pairs factored leaves are fitted on
  ``shifted_query``  decode that rotates the query per shift instead of every borrowed key
  ``deviation_factors``   factored leaves: a reader's recomputed tokens kept as low-rank factors of
                     their deviation from the owner's KV, read as additive terms (and the naive
                     reference of such reads)
"""

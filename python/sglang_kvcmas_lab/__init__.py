"""sglang_kvcmas_lab: the offline methods and measurements behind sglang-kvcmas (never served).

Reference models, every cache-sharing method behind one interface (``correction``), low-rank
delta leaves (``delta``) and the delta-attention kernels with their torch references
(``attention``). The labs under ``benchmark/lab/`` measure these against exact recompute.

The boundary is one way: the lab may import ``sglang_kvcmas`` (its RoPE helper, span type, model
resolution, data sets); the server never imports the lab (``test/test_boundaries.py``).
"""

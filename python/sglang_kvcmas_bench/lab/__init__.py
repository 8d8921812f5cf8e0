"""The labs' shared harness (``benchmark/lab/``): the reference forward and the no-sharing
ground truth (``reference``), records and summaries (``records``), the workloads
(``workloads``) and their dense transcripts (``transcripts``), deviation probes (``probes``),
the PReCache setup (``precache_setup``) and batched decode timing (``decode_throughput``)."""

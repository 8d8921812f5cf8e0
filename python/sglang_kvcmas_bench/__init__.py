"""sglang_kvcmas_bench: the benchmarks' shared harness (never served).

The scripts under ``benchmark/`` (serving, quality, kernels, lab) are run by path and import
only this package, the other packages under ``python/`` and third-party ones; no script imports
another. A module here has one job:

- ``model_arg``: ``--model-path`` for every benchmark, and the model part of result names;
- ``results``: a result file written together with its row in its folder's index;
- ``provenance``: the checkout, its commit, the machine;
- ``server_arms``, ``server_calls``, ``kv_sampler``, ``scheduler_profile``: boot one server per
  arm, call it over HTTP, sample its peak KV, profile its scheduler;
- ``workflows``, ``workload_runs``, ``debate_prompts``, ``review_panel``: the workloads;
- ``answers``, ``forced_reads``, ``reuse_records``, ``kv_ideal``, ``figures``: what a run is
  judged by (final answers, teacher-forced reads, reuse records, the one-copy ideal);
- ``host_sim``: the host path without the model;
- ``accuracy_tasks``, ``sandbox``, ``paired_stats``: the accuracy tasks, their code sandbox and
  paired statistics;
- ``kernel_timing``: CPU kernel timing and reader rows; ``gpu_summary``: the GPU check's summary;
- ``lab``: the labs' reference forward, records, workloads and probes.

Imports nothing at package level: ``results`` and ``provenance`` need only the standard library
(the GPU check's micro-benchmark imports them on a machine with PyTorch and Triton alone).
"""

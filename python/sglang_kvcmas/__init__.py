"""sglang-kvcmas: many agents, one KV cache for their shared transcript.

One exact base cache per shared segment plus each agent's thin leaves (the tokens it recomputed,
kept as factored deviations or exact), served by SGLang 0.5.23 through its plugin points.
Importing this package has no side effects: SGLang loads ``sglang_kvcmas.plugin:register``
through the ``sglang.srt.plugins`` entry point.
"""

__version__ = "0.1.0"
SGLANG_VERSION = "0.5.23"

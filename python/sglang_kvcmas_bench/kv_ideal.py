"""The one-copy ideal: the KV tokens a workload needs if each shared transcript is held once
(plus agent heads and the live suffixes), the yardstick of every peak-KV figure."""

from __future__ import annotations

KV_BYTES_PER_TOKEN = 30 * 3 * 64 * 2 * 4  # the embedded model's (BenchModel.kv_bytes_per_token)


def one_copy_ideal(turns: list[dict], chat=None) -> int:
    """Tokens if each shared transcript were held once, plus agent heads, plus the live suffix
    and output of the largest concurrent step of each workflow. ``chat``: the model's template
    markers (``model_arg.chat_markers``; default: the embedded model's ChatML ids)."""
    from sglang_kvcmas.tree.agent_split import detect_template_split
    from sglang_kvcmas.tree.template_markers import TemplateMarkers

    chat = chat or TemplateMarkers.chatml(1, 2, 198, system=(9690,), user=(4093,),
                                          assistant=(520, 9531))
    heads: dict[str, int] = {}
    shared: dict[tuple, int] = {}
    live: dict[tuple, int] = {}
    for t in turns:
        sp = detect_template_split(t["prompt_ids"], chat)
        heads[t["agent"]] = sp.head_len
        key = (t["kind"], t["wid"])
        shared[key] = max(shared.get(key, 0), sp.shared_len)
        step_live = sum(len(u["prompt_ids"]) - sp.shared_end + u["meta"]["completion_tokens"]
                        for u in turns if (u["kind"], u["wid"], u["step"]) == (*key, t["step"]))
        live[key] = max(live.get(key, 0), step_live)
    return sum(heads.values()) + sum(shared.values()) + sum(live.values())

"""The LoRA head-to-head's workload and bookkeeping (no server): workflow shapes, what a turn
prefilled, the final answer compared across arms, the adapters it serves."""

from __future__ import annotations

import pytest
from helpers.bench_scripts import load_script

bench = load_script("benchmark/serving/lora_head_to_head.py")
ARM_FIELDS, ARMS, CROSS_ADAPTER = bench.ARM_FIELDS, bench.ARMS, bench.CROSS_ADAPTER
LoraFlow = bench.LoraFlow
build_flows, flow_steps, last_answer = bench.build_flows, bench.flow_steps, bench.last_answer
parse_adapters, prefilled, request_fields = (bench.parse_adapters, bench.prefilled,
                                             bench.request_fields)
template_split = bench.template_split


def test_panel_and_chain_shapes():
    agents = ["planner", "solver", "critic"]
    assert flow_steps("panel", agents, 2) == [agents, agents]
    assert flow_steps("chain", agents, 2) == [["planner"], ["solver"], ["critic"]] * 2


def test_shots_put_worked_examples_of_each_flows_own_before_its_question():
    plain, shot = build_flows(2, [["planner"]]), build_flows(2, [["planner"]], shots=2)
    for p, s in zip(plain, shot):
        assert s.question.startswith("Worked example 1.\nQuestion: ")
        assert s.question.endswith(f"Question: {p.question}")
        assert s.question.count("Solution: ") == 2 and "<<" not in s.question
    assert shot[0].question.split("Question: ")[1] != shot[1].question.split("Question: ")[1]


def test_a_flow_prompt_is_the_shared_transcript_with_one_turn_opener():
    flow = LoraFlow(0, "What is 2 + 3?", [["planner"]], ["PLAN:\n1. Add. "])
    text = flow.prompt()
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert "<|im_start|>assistant\nPLAN:\n1. Add.<|im_end|>" in text


def test_prefilled_reads_our_record_else_sglangs_cached_tokens():
    ours = {"meta": {"prompt_tokens": 300, "cached_tokens": 200, "kvcmas_reuse": [
        {"reused_exact": 100, "reused_repositioned": 100, "recomputed": 100}]}}
    stock = {"meta": {"prompt_tokens": 300, "cached_tokens": 120}}
    assert prefilled(ours) == 100 and prefilled(stock) == 180


def test_the_final_answer_is_the_last_solver_turns_else_the_last_turns():
    turns = [{"wid": 0, "step": 0, "agent": "solver", "text": "ANSWER: 7"},
             {"wid": 0, "step": 3, "agent": "solver", "text": "ANSWER: 9"},
             {"wid": 0, "step": 4, "agent": "critic", "text": "VERDICT: 11"},
             {"wid": 1, "step": 0, "agent": "writer", "text": "so 5"}]
    assert last_answer(turns, 0) == "9" and last_answer(turns, 1) == "5"
    assert last_answer(turns, 2) is None


def test_requests_name_their_adapter_and_workflow():
    fields = request_fields(3, "critic", 64)
    assert fields["lora_path"] == "critic"
    assert fields["sampling_params"]["custom_params"] == {"kvcmas_workflow": "lora-3"}
    named = request_fields(3, "critic", 64, {"kvcmas_head_len": 30, "kvcmas_shared_end": 90})
    assert named["sampling_params"]["custom_params"] == {
        "kvcmas_workflow": "lora-3", "kvcmas_head_len": 30, "kvcmas_shared_end": 90}


def test_pick_arms_are_borrow_servers_whose_requests_set_valid_fields(monkeypatch):
    """An arm that varies an adapter reader's picks serves as ``borrow`` and sends its fields
    with every turn (and they are fields the server accepts)."""
    from sglang_kvcmas.policy.request_options import RequestOptions


    assert {"borrow_tail64", "borrow_mass10", "borrow_naive"} <= set(ARM_FIELDS)
    for arm, fields in ARM_FIELDS.items():
        assert ARMS[arm] == ARMS["borrow"] and arm in CROSS_ADAPTER
        opts = RequestOptions.parse(fields)
        assert opts.reads_leaves and opts.overrides
    sent = []

    def fake_generate(url, ids, max_new, fields):
        sent.append(fields["sampling_params"]["custom_params"])
        return {"ttft": 0.1, "latency": 0.2, "text": "x", "output_ids": [7], "meta": {}}

    class Tok:
        def encode(self, text, add_special_tokens=False):
            return [len(text)]

    monkeypatch.setattr(bench, "stream_generate", fake_generate)
    bench.run_flows("url", [LoraFlow(0, "Q?", [["planner"]])], Tok(), 8,
                    custom=ARM_FIELDS["borrow_tail64"])
    assert sent == [{"kvcmas_workflow": "lora-0", **ARM_FIELDS["borrow_tail64"]}]


def test_adapters_default_to_the_packaged_roles_and_bad_folders_are_refused(tmp_path):
    assert list(parse_adapters(None)) == ["planner", "solver", "critic"]
    assert list(parse_adapters(None, "embedded")) == ["planner", "solver", "critic"]
    qwen = parse_adapters(None, "qwen2.5-coder-0.5b")  # trained for it, shipped beside
    assert all(p.is_dir() and "qwen2_5_coder_0_5b" in str(p) for p in qwen.values())
    with pytest.raises(SystemExit, match="train them"):
        parse_adapters(None, "some-other-model")
    assert parse_adapters(f"a={tmp_path}") == {"a": tmp_path}
    with pytest.raises(SystemExit, match="name=folder"):
        parse_adapters(f"a={tmp_path / 'missing'}")


def test_a_replayed_arm_serves_the_stock_arms_prompts_and_decode_lengths(monkeypatch):

    sent = []

    def fake_generate(url, ids, max_new, fields):
        sent.append((tuple(ids), max_new, dict(fields["sampling_params"])))
        return {"ttft": 0.1, "latency": 0.2, "text": f"own {fields['lora_path']}",
                "output_ids": [7] * 3, "meta": {}}

    class Tok:
        def encode(self, text, add_special_tokens=False):
            return [len(text)]  # the prompt's length stands in for its tokens

    monkeypatch.setattr(bench, "stream_generate", fake_generate)
    steps = [["planner", "solver"]] * 2
    script = {(0, s, a): {"text": f"stock {a} {s}", "output_ids": [1] * (5 + s)}
              for s in range(2) for a in ("planner", "solver")}
    turns, _ = bench.run_flows("url", [LoraFlow(0, "Q?", steps)], Tok(), 64, script)
    assert [t["agent"] for t in turns] == ["planner", "solver"] * 2
    assert {m for _, m, _ in sent} == {5, 6}  # each turn decodes the stock turn's length
    assert all(p["ignore_eos"] and p["max_new_tokens"] in (5, 6) for _, _, p in sent)
    expected = LoraFlow(0, "Q?", steps, ["stock planner 0", "stock solver 0"]).prompt()
    assert turns[2]["prompt_ids"] == [len(expected)]  # grown by stock's messages, not its own
    own, _ = bench.run_flows("url", [LoraFlow(0, "Q?", steps)], Tok(), 64)
    assert own[2]["prompt_ids"] != turns[2]["prompt_ids"]


def test_requests_name_the_chat_templates_head_and_shared_transcript():
    """The split the chat route would send: the system turn, then the transcript up to the turn
    opener; a prompt without the template names nothing."""
    from sglang_kvcmas.models.resolve import resolve_model_path
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model_path(None))
    flow = LoraFlow(0, "What is 2 + 3?", [["planner"]], ["PLAN:\n1. Add. "])
    ids = tok.encode(flow.prompt(), add_special_tokens=False)
    named = template_split(tok)(ids)
    head = tok.decode(ids[: named["kvcmas_head_len"]])
    assert head.startswith("<|im_start|>system\n") and "What is" not in head
    assert tok.decode(ids[named["kvcmas_shared_end"]:]) == "<|im_start|>assistant\n"
    assert template_split(tok)(tok.encode("no template here", add_special_tokens=False)) == {}


def test_background_prefills_are_read_from_the_servers_metrics():
    """Only the named samples count (``_created`` and other kinds do not); absent ones are 0."""
    import http.server
    import threading

    background_prefilled = bench.background_prefilled

    body = b"\n".join([
        b'kvcmas:head_prefill_tokens_total{kind="prompt"} 500.0',
        b'kvcmas:head_prefill_tokens_total{kind="prefilled"} 300.0',
        b'kvcmas:other_tokens_total{kind="prefilled"} 20.0',
        b'kvcmas:head_prefill_tokens_created{kind="prefilled"} 1.7e9', b""])

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body if self.path == "/metrics" else b"")

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        assert background_prefilled(url) == 300
        body = b"# nothing of ours\n"
        assert background_prefilled(url) == 0
    finally:
        server.shutdown()

"""LoRA agents on SGLang's server: stock LoRA serving beside ours with ``--kvcmas-lora-share
borrow`` (the package's planner / solver / critic adapters on the embedded model, CPU).

What ``borrow`` promises, checked here end to end:

- requests without an adapter are served exactly as stock SGLang LoRA serving serves them (same
  tokens, same logprobs), even after adapters computed the same transcript;
- the first adapter to compute a transcript is an exact owner (its answer is stock's);
- a later adapter reads that transcript, as its ``usage`` reports, on the OpenAI chat route
  (``model="<base>:<adapter>"``) as on ``/generate`` (``lora_path``);
- never across ``cache_salt``;
- bad adapters: an unknown name is a 400, an adapter for another base model is refused by
  ``/load_lora_adapter`` (400, nothing loaded), and the server keeps serving with nothing
  leaked from its pool.

And what a ``borrow`` reader's picks promise: with every borrowed token recomputed it is its own
exact prefill, and its default picks read closer to exact than naive cross-adapter reuse; a
request that asks to read no other agent's KV is stock's.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
import uuid

import pytest
import torch
from safetensors.torch import save_file

from sglang_kvcmas.adapters import ROLES, role_adapter_dir
from sglang_kvcmas.adapters.role_data import SYSTEM, Message, chat_text
from sglang_kvcmas.server.process import ServerProcess

pytestmark = [pytest.mark.server, pytest.mark.slow]

LORA = ["--enable-lora", "--max-lora-rank", "8", "--lora-paths",
        *(f"{r}={role_adapter_dir('attn', r)}" for r in ROLES)]
QUESTION = ("A baker makes 24 muffins in the morning and 36 in the afternoon. She sells 45 "
            "of them and gives 5 to a neighbour. How many muffins does she have left? ") * 3
PLAN = "PLAN:\n1. Compute 24 + 36.\n2. Compute the muffins sold and given away.\n3. Report."


def post(url: str, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def generate(url: str, text: str | None, lora: str | None = None, **extra) -> dict:
    body = {"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": 8},
            "return_logprob": True, **extra}
    if lora is not None:
        body["lora_path"] = lora
    status, out = post(url, "/generate", body)
    assert status == 200, out
    return out


def prompt(question: str, *messages: str) -> str:
    msgs = [Message("system", SYSTEM), Message("user", question)]
    return chat_text([*msgs, *(Message("assistant", m) for m in messages)], open_turn=True)


def borrowed_in(rec: dict) -> int:
    """Prompt tokens a reuse record read off another agent's transcript:
    re-positioned, corrected, or recomputed at the reader's picks (the last
    ``LORA_RECOMPUTE_TAIL`` among them)."""
    return (rec.get("reused_repositioned", 0) + rec.get("reused_factored", 0)
            + rec.get("recomputed_borrowed", 0))


def borrowed(out: dict) -> int:
    """:func:`borrowed_in` of a ``/generate`` response's reuse record."""
    return borrowed_in((out["meta_info"].get("kvcmas_reuse") or [{}])[0])


def boot(tmp_path_factory, name: str, flags: list[str]):
    process = ServerProcess(args=[*flags, *LORA],
                            log_path=tmp_path_factory.mktemp(name) / "server.log",
                            boot_timeout_s=400)
    process.start()
    return process


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    stock = boot(tmp_path_factory, "lora-stock", ["--kvcmas-stock-cache"])
    try:
        ours = boot(tmp_path_factory, "lora-borrow",
                    ["--kvcmas-share-context", "--kvcmas-lora-share", "borrow"])
        try:
            for url in (stock.url, ours.url):  # each adapter's head cached, as in a deployment
                for role in ROLES:
                    generate(url, prompt("What is 2 + 2?"), role)
            yield stock.url, ours.url
        finally:
            ours.stop()
    finally:
        stock.stop()


def test_adapters_share_the_transcript_and_the_base_model_stays_stock(servers):
    stock, ours = servers
    q = QUESTION + uuid.uuid4().hex[:6]
    first = {u: generate(u, prompt(q), "planner") for u in servers}
    assert first[ours]["output_ids"] == first[stock]["output_ids"]
    assert borrowed(first[ours]) == 0  # the first adapter computes it: an exact owner
    second = generate(ours, prompt(q, PLAN), "solver")
    assert borrowed(second) > 80  # the question, computed by the planner's adapter
    # Without an adapter: nothing borrowed from the adapters, stock's tokens and logprobs.
    base = {u: generate(u, prompt(q, PLAN)) for u in servers}
    assert borrowed(base[ours]) == 0
    assert base[ours]["output_ids"] == base[stock]["output_ids"]
    lp = [[x[0] for x in base[u]["meta_info"]["output_token_logprobs"]] for u in servers]
    assert lp[0] == lp[1]


def test_chat_requests_of_two_adapters_report_the_reuse_in_usage(servers):
    _, ours = servers
    q = QUESTION + uuid.uuid4().hex[:6]

    def chat(adapter: str, *assistant: str) -> dict:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
        messages += [{"role": "assistant", "content": m} for m in assistant]
        status, out = post(ours, "/v1/chat/completions", {
            "model": f"default:{adapter}", "messages": messages, "max_tokens": 4,
            "temperature": 0})
        assert status == 200, out
        return out["usage"]["prompt_tokens_details"]

    assert chat("planner")["kvcmas_reused_repositioned"] == 0
    details = chat("critic", PLAN)
    read = details["kvcmas_reused_repositioned"] + details["kvcmas_reused_factored"]
    assert read > 40 and read + details["kvcmas_recomputed_borrowed"] > 80, details


def test_never_across_cache_salt(servers):
    _, ours = servers
    q = QUESTION + uuid.uuid4().hex[:6]
    generate(ours, prompt(q), "planner", cache_salt="tenant-a")
    for salt, role in (("tenant-b", "solver"), ("tenant-a", "critic")):  # heads under each salt
        generate(ours, prompt("What is 2 + 2?"), role, cache_salt=salt)
    assert borrowed(generate(ours, prompt(q, PLAN), "solver", cache_salt="tenant-b")) == 0
    assert borrowed(generate(ours, prompt(q, PLAN), "critic", cache_salt="tenant-a")) > 80


def pool_balanced(url: str) -> bool:
    with urllib.request.urlopen(url + "/server_info", timeout=30) as r:
        state = json.loads(r.read())["internal_states"][0]["kvcmas"]
    return state.get("invariants_ok", True) and not state.get("faults")


def test_bad_adapters_get_a_clear_400_and_the_server_keeps_serving(servers, tmp_path):
    _, ours = servers
    status, out = post(ours, "/generate", {"text": "Hi", "lora_path": "no-such-adapter",
                                           "sampling_params": {"max_new_tokens": 2}})
    assert status == 400 and "no-such-adapter" in json.dumps(out)
    wrong = tmp_path / "wrong-base"
    wrong.mkdir()
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight":
               torch.zeros(8, 896),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight":
               torch.zeros(896, 8)}, str(wrong / "adapter_model.safetensors"))
    (wrong / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}))
    status, out = post(ours, "/load_lora_adapter", {"lora_name": "wrong", "lora_path": str(wrong)})
    assert status == 400 and "another base model" in out["error_message"], out
    status, out = post(ours, "/generate", {"text": "Hi", "lora_path": "wrong",
                                           "sampling_params": {"max_new_tokens": 2}})
    assert status == 400  # never loaded
    assert generate(ours, prompt("What is 3 + 4?"), "solver")["output_ids"]
    assert pool_balanced(ours)


def test_an_exact_request_reads_no_other_adapters_kv(servers):
    stock, ours = servers
    q = QUESTION + uuid.uuid4().hex[:6]
    generate(ours, prompt(q), "planner")
    exact = generate(ours, prompt(q, PLAN), "critic",
                     sampling_params={"temperature": 0, "max_new_tokens": 8,
                                      "custom_params": {"kvcmas_exact": True}})
    assert borrowed(exact) == 0
    assert exact["output_ids"] == generate(stock, prompt(q, PLAN), "critic")["output_ids"]
    assert pool_balanced(ours)


def test_a_borrow_readers_picks_bring_it_closer_to_exact(servers):
    """With every borrowed token picked a reader is its own exact prefill; with its default
    picks it deviates from exact less than naive cross-adapter reuse (nothing recomputed).
    Teacher-forced over the exact greedy continuation, each read under a fresh ``cache_salt``,
    the transcript owned by another adapter."""
    from transformers import AutoTokenizer

    from sglang_kvcmas.models.resolve import resolve_model_path
    from sglang_kvcmas_bench.forced_reads import compare, forced

    stock, borrow = servers
    tok = AutoTokenizer.from_pretrained(resolve_model_path(None))
    ids = tok.encode(prompt(QUESTION + uuid.uuid4().hex[:6], PLAN), add_special_tokens=False)
    solver = {"lora_path": "solver"}
    cont = generate(stock, None, "solver", input_ids=ids,
                    sampling_params={"temperature": 0, "max_new_tokens": 16})["output_ids"]
    ref = forced(stock, ids, cont, f"exact-{uuid.uuid4()}", body=solver)

    def read(config: tuple[int, float, int] | None):
        salt = f"read-{uuid.uuid4()}"
        generate(borrow, prompt("What is 2 + 2?"), "solver", cache_salt=salt)  # its head
        generate(borrow, None, "planner", input_ids=ids + cont, cache_salt=salt)  # the owner
        got = forced(borrow, ids, cont, salt, config=config, body=solver)
        assert borrowed_in(got["record"]) > 80, got["record"]
        return compare(ref, got, cont)

    picked_all = read((0, 1.0, 0))
    default = read(None)
    naive = read((0, 0.0, 0))
    assert picked_all["top1"] == 1.0 and picked_all["kl20"] < 1e-6, picked_all
    assert default["kl20"] < naive["kl20"], (default, naive)
    assert pool_balanced(borrow)

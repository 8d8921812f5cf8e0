"""End to end on SGLang's server with the shared-context path (one server for the module, one
more with a small prefill chunk): two agents' chat requests over one transcript show corrected
re-positioned reuse in their ``usage`` (streamed or not, the same fields); bad ``kvcmas_*`` fields
are answered 400 and the server keeps serving; the owner's logits are bit-identical to a from-scratch computation;
``cache_salt`` isolates tenants; readers released together under chunked prefill each recompute
in one piece."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from sglang_kvcmas.config import ServingConfig

pytestmark = [pytest.mark.slow, pytest.mark.server]

SA = ("You are Ada, a careful mathematician who checks every step of an argument and states "
      "the final answer as a number.")
SB = ("You are Ben, a skeptical reviewer who looks for the one most likely mistake in the "
      "other agents' answers before agreeing.")
T1 = ("Question: A farmer has 17 sheep. He buys 5 more and then sells 3 of them at the market. "
      "How many sheep does the farmer have now? Explain your reasoning in two sentences.")
T2 = T1 + (
    "\n\nRound 1 answers:\nAda: The farmer starts with 17 sheep. Buying 5 more gives 17 + 5 = 22 "
    "sheep, because buying adds to the flock. Selling 3 of them removes 3, so 22 - 3 = 19 sheep "
    "remain. I checked both steps again: the purchase happens before the sale, and nothing else "
    "changes the number of sheep, so the order of the steps does not matter for the total. "
    "Final answer: 19\nBen: I looked for the most likely mistake, which would be adding the sold "
    "sheep instead of subtracting them, or forgetting the purchase. Ada did neither: 17 plus 5 is "
    "22, and 22 minus 3 is 19. Another check: the net change is 5 - 3 = 2, and 17 + 2 = 19, the "
    "same number. The question asks how many he has now, not how many he bought or sold, so the "
    "answer is the final count. Final answer: 19\nCleo: Both of you agree and both computations "
    "are consistent. I would only add that the problem gives no reason to doubt the numbers: no "
    "sheep are born, lost or given away, and the market sale is the only reduction. So the flock "
    "is 17 at the start, 22 after the purchase and 19 after the sale. Final answer: 19\n\nThis is "
    "round 2. Considering the answers above, give your updated answer.")
"""Round 2's transcript: more than ``policy.recompute.MIN_BORROWED`` (128) new tokens, so a reader borrows."""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from sglang_kvcmas_bench.server_arms import ArmServer

    log = tmp_path_factory.mktemp("kvcmas") / "server.log"
    with ArmServer("kvcmas", log) as s:
        yield s


def post(url, body, headers=None):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def chat(server, system, user, **extra):
    return post(server.url + "/v1/chat/completions", {
        "model": "default", "temperature": 0, "max_tokens": 8,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        **extra})


def test_second_agent_reads_first_agents_transcript(server):
    chat(server, SA, T1)
    chat(server, SB, T1)  # both heads cached now
    owner = chat(server, SA, T2)["usage"]["prompt_tokens_details"]
    reader = chat(server, SB, T2)["usage"]["prompt_tokens_details"]
    assert owner["kvcmas_reused_repositioned"] == 0 and owner["kvcmas_recomputed"] > 60
    assert reader["kvcmas_reused_repositioned"] > 40, reader
    assert owner["kvcmas_reused_factored"] == reader["kvcmas_reused_factored"] == 0
    # One borrowed span (T2 after T1): its boundary plus the owner's top head-mass tokens.
    borrowed = reader["kvcmas_reused_repositioned"] + reader["kvcmas_recomputed_borrowed"]
    defaults = ServingConfig()
    boundary = defaults.recompute_boundary
    extra = round(defaults.recompute_mass_fraction * borrowed)
    assert reader["kvcmas_recomputed_borrowed"] == boundary + extra
    assert boundary + extra < reader["kvcmas_recomputed"] < 10 + boundary + extra
    assert reader["cached_tokens"] == (reader["kvcmas_reused_exact"]
                                       + reader["kvcmas_reused_repositioned"])
    # Its factored leaves now (the default leaf mode): the picks read through their factors.
    again = chat(server, SB, T2)["usage"]["prompt_tokens_details"]
    assert (again["kvcmas_reused_factored"], again["kvcmas_exact_from_leaves"]) == (
        boundary + extra, 0)
    assert again["kvcmas_recomputed"] == reader["kvcmas_recomputed"] - boundary - extra
    assert again["kvcmas_reused_exact"] == reader["kvcmas_reused_exact"]


def chat_stream(server, system, user, **extra):
    """A streamed chat with the usage chunk; returns that chunk's usage."""
    body = {"model": "default", "temperature": 0, "max_tokens": 8, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": user}], **extra}
    req = urllib.request.Request(server.url + "/v1/chat/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    usage = None
    with urllib.request.urlopen(req, timeout=300) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage") or usage
    return usage


def test_streamed_and_plain_usage_carry_the_same_kvcmas_fields(server):
    chat(server, SA, T1)
    plain = chat(server, SB, T2 + " Plain.")["usage"]["prompt_tokens_details"]
    streamed = chat_stream(server, SB, T2 + " Streamed.")["prompt_tokens_details"]
    ours = {k for k in plain if k.startswith("kvcmas_")}
    assert ours == {k for k in streamed if k.startswith("kvcmas_")}
    assert {"kvcmas_reused_exact", "kvcmas_reused_factored", "kvcmas_reused_repositioned",
            "kvcmas_recomputed", "kvcmas_workflow"} <= ours
    assert streamed["cached_tokens"] == plain["cached_tokens"] or streamed["kvcmas_recomputed"]


def test_workflow_header_labels_the_request(server):
    req = urllib.request.Request(
        server.url + "/v1/chat/completions", data=json.dumps({
            "model": "default", "temperature": 0, "max_tokens": 2,
            "messages": [{"role": "system", "content": SA}, {"role": "user", "content": T1}],
        }).encode(), headers={"Content-Type": "application/json", "X-KVCMAS-Workflow": "wf-7"})
    with urllib.request.urlopen(req, timeout=300) as r:
        details = json.loads(r.read())["usage"]["prompt_tokens_details"]
    assert details["kvcmas_workflow"] == "wf-7"
    out = post(server.url + "/generate", {"text": "Hi", "sampling_params": {
        "max_new_tokens": 1, "custom_params": {"kvcmas_workflow": "wf-8"}}})
    assert out["meta_info"]["kvcmas_reuse"][0]["workflow"] == "wf-8"


def test_workflow_ledger_adds_up_each_workflows_requests(server):
    usages = []
    for system in (SA, SB):  # two agents of one workflow, over one transcript
        usages.append(chat(server, system, T1,
                           custom_params={"kvcmas_workflow": "wf-ledger"})["usage"])
    scored = post(server.url + "/generate", {  # a prompt scored, nothing generated
        "text": "Question: how many legs has a spider?",
        "sampling_params": {"max_new_tokens": 0, "custom_params": {"kvcmas_workflow": "wf-ledger"}}})
    record = scored["meta_info"]["kvcmas_reuse"][0]
    assert record["workflow"] == "wf-ledger" and record["prompt_tokens"] > 0
    usages.append({"prompt_tokens": record["prompt_tokens"], "completion_tokens": 0,
                   "prompt_tokens_details": {f"kvcmas_{k}": record[k] for k in
                                             ("reused_exact", "reused_repositioned",
                                              "recomputed")}})
    with urllib.request.urlopen(server.url + "/kvcmas/workflows/wf-ledger", timeout=60) as r:
        flow = json.loads(r.read())
    assert flow["requests"] == 3 and flow["agents"] == 2 and len(flow["turns"]) == 3
    assert flow["prompt_tokens"] == sum(u["prompt_tokens"] for u in usages)
    assert flow["completion_tokens"] == sum(u["completion_tokens"] for u in usages)
    for field in ("reused_exact", "reused_repositioned", "recomputed"):
        assert flow[field] == sum(u["prompt_tokens_details"][f"kvcmas_{field}"] for u in usages)
    assert flow["computed"] == flow["recomputed"] + flow["completion_tokens"]
    per_token = flow["kv_bytes_read"] // flow["prompt_tokens"]  # the served pool's slot size
    assert per_token > 0 and flow["kv_bytes_read"] == flow["prompt_tokens"] * per_token
    assert flow["kv_bytes_written"] == flow["computed"] * per_token
    assert sum(t["kv_bytes_written"] for t in flow["turns"]) == flow["kv_bytes_written"]
    assert flow["in_flight"] == 0 and [t["in_flight"] for t in flow["turns"]] == [0, 0, 0]
    with urllib.request.urlopen(server.url + "/kvcmas/workflows?limit=5", timeout=60) as r:
        listing = json.loads(r.read())
    assert listing["workflows"][0]["workflow"] == "wf-ledger"
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(server.url + "/kvcmas/workflows/never-seen", timeout=60)
    assert missing.value.code == 404
    with urllib.request.urlopen(server.url + "/metrics", timeout=60) as r:
        metrics = r.read().decode()
    series = [line for line in metrics.splitlines()
              if line.startswith("kvcmas:workflow_tokens_total{") and 'workflow="wf-ledger"' in line
              and 'kind="prompt"' in line]
    assert series and float(series[0].rsplit(" ", 1)[1]) == flow["prompt_tokens"], series
    written = [line for line in metrics.splitlines()
               if line.startswith("kvcmas:workflow_kv_bytes_total{")
               and 'workflow="wf-ledger"' in line and 'kind="written"' in line]
    assert written and float(written[0].rsplit(" ", 1)[1]) == flow["kv_bytes_written"], written


BAD_FIELDS = [
    ({"kvcmas_head_len": None}, "kvcmas_head_len"),
    ({"kvcmas_head_len": [16]}, "kvcmas_head_len"),
    ({"kvcmas_head_len": {}}, "kvcmas_head_len"),
    ({"kvcmas_head_len": 1.5}, "kvcmas_head_len"),
    ({"kvcmas_head_len": True}, "kvcmas_head_len"),
    ({"kvcmas_head_len": 4, "kvcmas_shared_end": None}, "kvcmas_shared_end"),
    ({"kvcmas_head_len": 9999}, "kvcmas_head_len=9999 is past the prompt"),
    ({"kvcmas_recompute_mass_fraction": 7}, "kvcmas_recompute_mass_fraction"),
    ({"kvcmas_exact": "yes"}, "kvcmas_exact"),
    ({"kvcmas_nonsense": 1}, "unknown field custom_params.kvcmas_nonsense"),
    (5, "custom_params must be an object"),
    ([1, 2], "custom_params must be an object"),
    ("x", "custom_params must be an object"),
]


@pytest.mark.parametrize("custom, message", BAD_FIELDS)
def test_bad_kvcmas_fields_are_a_400_and_the_server_keeps_serving(server, custom, message):
    body = {"text": "Hello there", "sampling_params": {"max_new_tokens": 1,
                                                        "custom_params": custom}}
    req = urllib.request.Request(server.url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=60)
    assert e.value.code == 400
    assert message in e.value.read().decode()
    assert post(server.url + "/generate", {"text": "Hi", "sampling_params": {
        "max_new_tokens": 1, "custom_params": {"thinking_budget": 3}}})["text"] is not None


def test_reader_with_recomputed_boundary_tracks_exact_computation(server):
    """Teacher-forced over the exact computation's continuation, a reader that recomputes its
    borrowed span's first tokens (moved to the front of its extend) agrees with the exact
    computation, and at least as closely as naive reuse. (An explicit per-request boundary
    bypasses the agent's exact leaves, so both reads start from the owner's KV alone.)"""
    tok = tokenizer()
    chat(server, SA, T1)
    chat(server, SB, T1)
    chat(server, SA, T2)  # SA owns T2
    ids = chat_ids(tok, SB, T2)
    exact = post(server.url + "/generate", {
        "input_ids": ids, "cache_salt": "exact", "sampling_params": {
            "temperature": 0, "max_new_tokens": 24, "ignore_eos": True}})
    cont = tok.encode(exact["text"], add_special_tokens=False)

    def forced(boundary, salt=None, mass=0.0):
        body = {"input_ids": ids + cont, "return_logprob": True, "logprob_start_len": len(ids),
                "sampling_params": {"temperature": 0, "max_new_tokens": 1, "custom_params": {
                    "kvcmas_recompute_boundary": boundary,
                    "kvcmas_recompute_mass_fraction": mass}}}
        if salt:
            body["cache_salt"] = salt
        meta = post(server.url + "/generate", body)["meta_info"]
        return [x[0] for x in meta["input_token_logprobs"]], meta["kvcmas_reuse"][0]

    ref, _ = forced(0, salt="exact-tf")
    naive, naive_rec = forced(0, mass=0.0)
    fixed, fixed_rec = forced(16, mass=0.0)
    assert naive_rec["recomputed_borrowed"] == 0 and naive_rec["reused_repositioned"] > 60
    assert fixed_rec["recomputed_borrowed"] == 16
    assert fixed_rec["reused_repositioned"] == naive_rec["reused_repositioned"] - 16
    def mean_abs_diff(got):
        pairs = [(a, b) for a, b in zip(ref, got) if a is not None and b is not None]
        assert len(pairs) >= 16
        return sum(abs(a - b) for a, b in pairs) / len(pairs)

    massed, massed_rec = forced(16, mass=0.2)  # + the owner's top head-mass tokens
    assert massed_rec["recomputed_borrowed"] > 16
    err = {"naive": mean_abs_diff(naive), "fixed": mean_abs_diff(fixed),
           "mass": mean_abs_diff(massed)}
    assert err["fixed"] < 0.1 and err["fixed"] <= err["naive"] * 1.05, err
    assert err["mass"] <= err["naive"] * 1.05, err


def tokenizer():
    from sglang_kvcmas.models.resolve import resolve_model_path
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path(None))


def chat_ids(tok, system, user):
    ids = tok.apply_chat_template([{"role": "system", "content": system},
                                   {"role": "user", "content": user}],
                                  add_generation_prompt=True, tokenize=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def test_owner_is_bit_identical_and_salt_isolates(server):
    tok = tokenizer()
    # A new agent over a new transcript: it owns everything it computes (sharing on), and must
    # compute exactly what a request with nothing shared computes (another tenant, same shapes).
    ids = chat_ids(tok, SA.replace("Ada", "Cleo"), T2.replace("17", "23"))

    def logprobs(salt):
        out = post(server.url + "/generate", {
            "input_ids": ids, "return_logprob": True, "logprob_start_len": len(ids) - 20,
            "cache_salt": salt, "sampling_params": {"temperature": 0, "max_new_tokens": 4}})
        return out["meta_info"]

    shared = logprobs(None)  # the owner, under the shared-context tree
    fresh = logprobs("isolated-tenant")  # another tenant: nothing cached, nothing shared
    assert fresh["cached_tokens"] == 0
    assert fresh["kvcmas_reuse"][0]["reused_repositioned"] == 0
    assert shared["kvcmas_reuse"][0]["reused_repositioned"] == 0
    assert [x[0] for x in shared["input_token_logprobs"]] == [
        x[0] for x in fresh["input_token_logprobs"]]
    assert [x[0] for x in shared["output_token_logprobs"]] == [
        x[0] for x in fresh["output_token_logprobs"]]


def test_credentials_isolate_tenants_whatever_the_body_says(server):
    """Two tenants (``Authorization``), the same agents, transcript and body ``cache_salt``:
    the second computes everything the first cached; forged scopes are refused."""
    tok = tokenizer()
    a, b = {"Authorization": "Bearer key-a"}, {"Authorization": "Bearer key-b"}
    head, other_head = SA.replace("Ada", "Dora"), SB.replace("Ben", "Eli")

    def gen(system, transcript, headers):
        return post(server.url + "/generate", {
            "input_ids": chat_ids(tok, system, transcript.replace("17", "31")),
            "cache_salt": "team", "sampling_params": {
                "temperature": 0, "max_new_tokens": 2,
                "custom_params": {"kvcmas_workflow": "wf"}}},
            {**headers, "X-SMG-Tenant-Id": "a"})["meta_info"]

    gen(head, T1, a)
    gen(other_head, T1, a)  # both heads cached in a's namespace
    gen(head, T2, a)
    reader = gen(other_head, T2, a)  # the same tenant borrows the transcript
    assert reader["kvcmas_reuse"][0]["reused_repositioned"] > 40
    other = gen(head, T2, b)  # another tenant: nothing of a's
    assert other["cached_tokens"] == 0
    assert other["kvcmas_reuse"][0]["reused_repositioned"] == 0
    assert other["kvcmas_reuse"][0]["workflow"].endswith("/wf")
    assert other["kvcmas_reuse"][0]["workflow"] != reader["kvcmas_reuse"][0]["workflow"]
    from sglang_kvcmas.policy.tenancy import TENANT_SALT_PREFIX, tenant_of

    scope = tenant_of({"authorization": a["Authorization"]})
    for forged, headers in (({"cache_salt": f"{TENANT_SALT_PREFIX}{scope}/team"}, b),
                            ({"sampling_params": {"custom_params": {
                                "kvcmas_workflow": f"{scope}/wf"}}}, {})):
        with pytest.raises(urllib.error.HTTPError) as e:
            post(server.url + "/generate", {"input_ids": [1, 2, 3], **forged}, headers)
        assert e.value.code == 400


def test_server_info_reports_a_consistent_tree(server):
    """After every test above, the shared tree's bookkeeping holds and no leader is left
    pending (``/server_info`` → ``internal_states[i].kvcmas.shared_tree``)."""
    with urllib.request.urlopen(server.url + "/server_info", timeout=60) as r:
        info = json.loads(r.read())
    (state,) = [s["kvcmas"] for s in info["internal_states"] if "kvcmas" in s]
    tree = state["shared_tree"]
    assert tree["invariants"] == [] and tree["pending_owners"] == 0, tree
    assert tree["shared_nodes"] > 0
    # Every forward counted once by its attention path: on CPU (kvcmas_delta) exact batches run
    # torch_native's code, owners' probe batches and readers our torch path.
    batches, tokens = (state["dispatch"][k] for k in ("forward_batches", "forward_tokens"))
    assert batches["stock"]["plain"] > 0 and batches["torch"]["no_kernel"] > 0, batches
    assert batches["torch"]["probe_on_torch_native"] > 0 and "kernel" not in batches, batches
    assert all(tokens[p][r] >= n for p, by in batches.items() for r, n in by.items()), tokens


CHUNK = 64
SC = SA.replace("Ada, a careful mathematician who checks every step of an argument",
                "Cleo, a patient teacher who explains every step of an argument in plain words")


@pytest.fixture(scope="module")
def chunked_server(tmp_path_factory):
    from sglang_kvcmas_bench.server_arms import ArmServer

    log = tmp_path_factory.mktemp("kvcmas_chunked") / "server.log"
    with ArmServer("kvcmas", log, ["--chunked-prefill-size", str(CHUNK)]) as s:
        yield s, log


def test_readers_released_together_each_recompute_whole(chunked_server):
    """A reader's recomputed tokens sit at the front of its extend, so the extend must run in
    one piece. Two readers released together after their leader share a prefill batch whose
    chunk budget holds only one of them: SGLang would truncate the second (a scheduler
    exception). It must go whole in a later batch and recompute what the first does."""
    server, log = chunked_server
    for system in (SA, SB, SC):
        chat(server, system, T1)  # every head cached, T1 held exactly by each agent
    with ThreadPoolExecutor(3) as pool:
        outs = list(pool.map(lambda s: chat(server, s, T2), (SA, SB, SC)))
    details = [o["usage"]["prompt_tokens_details"] for o in outs]
    readers = [d for d in details if d["kvcmas_reused_repositioned"] > 0]
    assert len(readers) == 2, details
    assert all(d["kvcmas_recomputed_borrowed"] > 0 for d in readers), details
    assert 2 * min(d["kvcmas_recomputed"] for d in readers) > CHUNK, "they fit one chunk"
    text = log.read_text()
    assert "Scheduler hit an exception" not in text
    assert "waits for a batch that holds its extend whole" in text, "no reader was cut: untested"
    assert chat(server, SB, T1 + " Be brief.")["usage"]["prompt_tokens"] > 0  # still serving


def test_sglangs_own_backend_as_dispatcher_reads_borrowed_kv_the_same(server, tmp_path):
    """With sharing on, SGLang's ``torch_native`` backend becomes a dispatcher (what ``triton``
    and ``flashinfer`` become on GPU): batches that read borrowed KV take the delta read path,
    the others its own. A reader's extend and decode then give the same tokens and logprobs as
    under ``kvcmas_delta``."""
    from sglang_kvcmas_bench.server_arms import ArmServer

    tok = tokenizer()

    def run(url):
        def gen(system, user, n=8):
            return post(url + "/generate", {
                "input_ids": chat_ids(tok, system, user), "cache_salt": "dispatch",
                "return_logprob": True, "top_logprobs_num": 4,  # output side: keeps the match
                "sampling_params": {"temperature": 0, "max_new_tokens": n}})["meta_info"]

        gen(SA, T1, 1)
        gen(SB, T1, 1)
        gen(SA, T2, 1)
        reader = gen(SB, T2)
        reuse = reader["kvcmas_reuse"][0]
        assert reuse["reused_repositioned"] > 40 and reuse["recomputed_borrowed"] > 0, reuse
        return reader["output_token_logprobs"], reader["output_top_logprobs"], reuse

    delta = run(server.url)
    with ArmServer("kvcmas", tmp_path / "dispatch.log",
                   extra_args=["--attention-backend", "torch_native"]) as dispatch:
        assert run(dispatch.url) == delta
        log = (tmp_path / "dispatch.log").read_text(errors="replace")
    assert "attention backend 'torch_native' (TorchNativeAttnBackend) with sharing" in log

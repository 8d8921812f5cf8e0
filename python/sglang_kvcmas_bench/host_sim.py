"""The host path of sharing without the model: our tree cache and turn-order hook driven exactly
as SGLang's scheduler drives them (match, lock, prefix slots, row hand-off, checkpoint, release;
the hook around the prefill-batch decision) over a simulated KV pool, so what is timed is our
host code and SGLang's radix matching, nothing else.

The workflow (:func:`run`): ``agents`` agents with their own system prompts take turns over a
transcript that grows by ``segment`` tokens a round; each round's leader (a different agent each
round, so the transcript's segments have many owners) computes the new segment and the others
read it borrowed, recomputing their boundary and mass tokens and keeping them as exact leaves
(the serving defaults), so a late reader's borrowed path is as fragmented as it gets in a real
run. ``benchmark/serving/host_path.py`` runs it alone; ``scale.py`` runs it as its ``host`` part.
"""

from __future__ import annotations

import statistics
import sys
import time
from array import array
from types import SimpleNamespace

import torch
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang_kvcmas.config import ServingConfig
from sglang_kvcmas.integration import turn_order_hook
from sglang_kvcmas.integration.shared_tree_cache import KvcmasSharedTreeCache
from sglang_kvcmas.tree.template_markers import TemplateMarkers

NL = 5


CHAT = TemplateMarkers.chatml(im_start=1, im_end=2, newline=NL, system=(9,), user=(7,),
                              assistant=(8,))


SUFFIX = [2, NL, 1, 8, NL]  # <|im_end|>\n<|im_start|>assistant\n


class _Allocator:
    device = "cpu"

    def __init__(self) -> None:
        self.freed = 0

    def free(self, idx: torch.Tensor) -> None:
        self.freed += int(idx.numel())

    def free_segment(self, idx: torch.Tensor, *, start_pos: int) -> None:
        self.free(idx)


class _Pool:
    def __init__(self, rows: int, width: int) -> None:
        self.req_to_token = torch.zeros(rows, width, dtype=torch.int64)

    def write(self, where: tuple, values: torch.Tensor) -> None:
        self.req_to_token[where] = values


class _Req:
    """The fields of SGLang's ``Req`` that the tree cache and the hook read."""

    def __init__(self, rid: str, ids: list[int]) -> None:
        self.rid, self.cache_salt, self.extra_key = rid, None, None
        self.origin_input_ids = array("q", ids)  # as SGLang's tokenizer manager sends them
        self.full_untruncated_fill_ids = array("q", ids)
        self.sampling_params = SimpleNamespace(custom_params=None)
        self.kv = SimpleNamespace(req_pool_idx=None, cache_protected_len=0, cache_inserted_len=0,
                                  swa_evict_floor=0)
        self.lock = self.last_node = self.customized_info = None
        self.prefix_len = self.num_matched_prefix_tokens = 0
        self.priority, self.done = None, False
        self.return_logprob = False

    def finished(self) -> bool:
        return self.done


class HostSim:
    """One tree cache over a simulated pool, served request by request as the scheduler does.

    Args:
        rows: request rows of the simulated ``req_to_token`` pool.
        width: tokens per row (≥ the longest prompt).
    """

    def __init__(self, rows: int, width: int, config: ServingConfig) -> None:
        self.alloc = _Allocator()
        self.pool = _Pool(rows, width)
        self.cache = KvcmasSharedTreeCache(
            CacheInitParams(disable=False, req_to_token_pool=self.pool,
                            token_to_kv_pool_allocator=self.alloc, page_size=1),
            markers=CHAT, config=config)
        self.next_slot = 1
        self.gen = torch.Generator().manual_seed(0)

    def admit(self, req: _Req, row: int) -> float:
        """Match, lock, place the prefix in the row and hand the row off; seconds spent in the
        tree cache (the simulated pool write between is SGLang's, not timed)."""
        n = len(req.origin_input_ids)
        t0 = time.perf_counter()
        res = self.cache.match_prefix(MatchPrefixParams(
            key=RadixKey(req.full_untruncated_fill_ids, None, cache_salt=None, limit=n - 1),
            req=req))
        req.prefix_len, req.last_node = res.device_prefix_len, res.last_device_node
        req.kv.cache_protected_len = req.num_matched_prefix_tokens = req.prefix_len
        req.lock = self.cache.lock(req.last_node)
        prefix = (self.cache.prefix_device_indices(req) if req.prefix_len
                  else torch.empty(0, dtype=torch.int64))
        took = time.perf_counter() - t0
        new = torch.arange(self.next_slot, self.next_slot + n - req.prefix_len)
        self.pool.req_to_token[row, :n] = torch.cat([prefix, new])
        req.kv.req_pool_idx = row
        t0 = time.perf_counter()
        self.cache.maybe_hand_to_session(req)
        took += time.perf_counter() - t0
        self.next_slot += len(new)
        return took

    def finish(self, req: _Req) -> float:
        """Record head mass as the backend would, checkpoint, finish and release; seconds."""
        n = len(req.origin_input_ids)
        entry = getattr(req, "kvcmas_row", None)
        if entry is not None and entry.probe is not None:
            entry.probe.add(req.prefix_len,
                            torch.rand(n - req.prefix_len, generator=self.gen) ** 4)
        t0 = time.perf_counter()
        self.cache.checkpoint(req, up_to=n)
        req.done = True
        self.cache.checkpoint(req, up_to=n)
        row = self.pool.req_to_token[req.kv.req_pool_idx]
        self.alloc.free(row[req.kv.cache_protected_len : n])
        self.cache.unlock(req.lock)
        self.cache.on_release(req, checkpointed=True)
        return time.perf_counter() - t0


def agent_head(agent: int, length: int) -> list[int]:
    """A system turn of ``length`` tokens unique to the agent."""
    return [1, 9, NL] + [1000 + agent * 131 + i % 97 for i in range(length - 5)] + [2, NL]


def transcript(tokens: int, seed: int = 0) -> list[int]:
    """``tokens`` transcript token ids (user/assistant turns; never the ChatML delimiters)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(20, 30000, (tokens,), generator=g)).tolist()


def hook_ms(sim: HostSim, waiting: list[_Req], iters: int) -> list[float]:
    """Milliseconds per call of the turn-order hook around a prefill decision with ``waiting``
    queued (the leader of their segment in flight, so the others are held back)."""
    scheduler = SimpleNamespace(tree_cache=sim.cache, waiting_queue=list(waiting))
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        turn_order_hook.turn_order_around(lambda s: None, scheduler)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def run(agents: int = 16, transcript_tokens: int = 32768, segment: int = 2048, head: int = 120,
        hook_iters: int = 50) -> dict:
    """The workflow over a ``transcript_tokens`` transcript: one line per round on stderr; the
    rounds, the median host ms per reader admission in the last round
    (``host_ms_per_admission``) and per turn-order hook call with every other agent waiting
    (``hook_ms_per_iter``)."""
    args = SimpleNamespace(agents=agents, transcript=transcript_tokens, segment=segment,
                           head=head, hook_iters=hook_iters)
    config = ServingConfig(share_context=True)
    heads = [agent_head(a, args.head) for a in range(args.agents)]
    text = transcript(args.transcript)
    width = args.head + args.transcript + args.segment + len(SUFFIX) + 8
    sim = HostSim(args.agents + 2, width, config)
    rounds = []
    done = 0
    while done < args.transcript:
        done = min(args.transcript, done + args.segment)
        r = len(rounds)
        leader = r % args.agents
        order = [leader] + [a for a in range(args.agents) if a != leader]
        admit, finish = {}, {}
        for row, a in enumerate(order):
            req = _Req(f"r{r}a{a}", heads[a] + text[:done] + SUFFIX)
            admit[a] = sim.admit(req, row) * 1e3
            finish[a] = sim.finish(req) * 1e3
        readers = [admit[a] for a in order[1:]]
        rounds.append({"round": r, "transcript": done, "leader_admit_ms": admit[leader],
                       "reader_admit_ms_median": statistics.median(readers),
                       "reader_admit_ms_max": max(readers),
                       "finish_ms_median": statistics.median(finish.values()),
                       "shared_nodes": len(list(sim.cache.shared.nodes())),
                       "leaf_tokens": sim.cache.shared.exact_leaf_tokens()})
        print(f"[host] round {r:3d} transcript {done:6d}: reader admit median "
              f"{rounds[-1]['reader_admit_ms_median']:8.2f} ms  max "
              f"{rounds[-1]['reader_admit_ms_max']:8.2f} ms  finish median "
              f"{rounds[-1]['finish_ms_median']:7.2f} ms  nodes {rounds[-1]['shared_nodes']}  "
              f"leaf tokens {rounds[-1]['leaf_tokens']}", file=sys.stderr, flush=True)
    problems = sim.cache.shared.check_invariants()
    if problems:
        raise SystemExit(f"tree invariants broken: {problems}")
    # The next segment: its leader is admitted (in flight), everyone else waits for it.
    more = text + transcript(args.segment, seed=1)
    leader = len(rounds) % args.agents
    lead_req = _Req("next-leader", heads[leader] + more + SUFFIX)
    sim.admit(lead_req, 0)
    waiting = [_Req(f"next-a{a}", heads[a] + more + SUFFIX) for a in range(args.agents)
               if a != leader]
    hook = hook_ms(sim, waiting, args.hook_iters)
    held = turn_order_hook.held_count()
    return {
        "benchmark": "host_path", "agents": args.agents, "transcript": args.transcript,
        "segment": args.segment, "head": args.head, "rounds": rounds,
        "host_ms_per_admission": rounds[-1]["reader_admit_ms_median"],
        "hook_ms_per_iter": statistics.median(hook), "hook_waiting": len(waiting),
        "hook_held": held,
    }

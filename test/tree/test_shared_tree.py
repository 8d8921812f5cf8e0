"""Property test of the shared-context tree: random insert / match / lock / evict / drop sequences
keep its invariants (no slot freed twice, nothing freed while locked, sizes add up, matches return
exactly the slots inserted for those tokens), with exact and factored leaves held to the leaf
budget (every factored token keeps the factors adopted for its token path)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_kvcmas.attention.deviation_factors import FactorBasis, TokenFactors
from sglang_kvcmas.tree.shared_tree import SharedTree

NS = ("ns", None)

ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.lists(st.integers(0, 3), min_size=1, max_size=12),
                  st.booleans()),
        st.tuples(st.just("lock"), st.lists(st.integers(0, 3), min_size=1, max_size=12)),
        st.tuples(st.just("unlock"), st.integers(0, 20)),
        st.tuples(st.just("evict"), st.integers(1, 30)),
        st.tuples(st.just("drop"), st.integers(0, 5)),
        st.tuples(st.just("leaf"), st.lists(st.integers(0, 3), min_size=1, max_size=12),
                  st.integers(0, 2), st.lists(st.integers(0, 11), min_size=1, max_size=6)),
        st.tuples(st.just("trim"), st.integers(0, 12)),
        st.tuples(st.just("factor"), st.lists(st.integers(0, 3), min_size=1, max_size=12),
                  st.integers(0, 2), st.lists(st.integers(0, 11), min_size=1, max_size=6)),
        st.tuples(st.just("trim_bytes"), st.integers(0, 12)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_shared_tree_invariants(sequence):
    freed: list[int] = []
    tree = SharedTree(lambda s: freed.extend(int(x) for x in s))
    next_slot = [0]
    truth: dict[tuple[int, ...], int] = {}  # token path -> slot, for every live token
    anchors = [object() for _ in range(6)]
    locks = []
    factored: dict[tuple[str, tuple[int, ...]], float] = {}  # (agent, token path) -> its factor

    def fresh(n):
        s = torch.arange(next_slot[0], next_slot[0] + n)
        next_slot[0] += n
        return s

    for op in sequence:
        if op[0] == "insert":
            tokens, owned = op[1], op[2]
            known, _ = tree.match(NS, tokens, split=False)
            if known >= len(tokens):
                continue
            slots = fresh(len(tokens) - known)
            anchor = None if owned else anchors[len(tokens) % len(anchors)]
            matched, node = tree.insert(NS, tokens, known, slots, "a", 10 + known, anchor)
            assert matched == known and node is not None
            for i in range(known, len(tokens)):
                truth[tuple(tokens[: i + 1])] = int(slots[i - known])
        elif op[0] == "lock":
            n, node = tree.match(NS, op[1], split=True)
            if node is not None:
                tree.lock(node)
                locks.append((node, tuple(op[1][:n])))
        elif op[0] == "unlock" and locks:
            node, _ = locks.pop(op[1] % len(locks))
            tree.unlock(node)
        elif op[0] == "leaf":  # a reader adopts exact KV of some of a node's tokens
            n, node = tree.match(NS, op[1], split=True)
            if node is not None:
                offsets = torch.tensor(sorted({o % len(node) for o in op[3]}))
                slots = fresh(len(offsets))
                left = tree.add_overrides(node, f"r{op[2]}", offsets, slots, 100 + op[2])
                freed.extend(int(x) for x in left)  # the caller frees what was not adopted
        elif op[0] == "factor":  # a reader keeps factored tokens of a node (one fit)
            n, node = tree.match(NS, op[1], split=True)
            if node is not None:
                agent, offsets = f"r{op[2]}", sorted({o % len(node) for o in op[3]})
                ids = torch.arange(len(offsets), dtype=torch.float32) + 1 + len(factored) * 16
                f = TokenFactors(ids.reshape(1, -1, 1, 1), -ids.reshape(1, -1, 1, 1),
                                 FactorBasis(torch.ones(1, 1, 1, 1), torch.ones(1, 1, 1, 1),
                                             len(offsets)))
                old = node.factors.get(agent)
                held = set(old.offsets().tolist()) if old is not None else set()
                start = 100 + op[2] + n - len(node)  # the reader's position of the node's start
                added = tree.add_factors(node, agent, torch.tensor(offsets), f, start)
                if added:
                    prefix = [t for p in SharedTree.path(node) for t in p.node.key][: n - len(node)]
                    for o, i in zip(offsets, ids.tolist()):
                        if o not in held:
                            factored[(agent, tuple(prefix + list(node.key[: o + 1])))] = i
                    assert added == len(set(offsets) - held)
        elif op[0] == "trim_bytes":  # the budget over both types, factors in tokens of 4 bytes
            tree.trim_leaves(op[1], bytes_per_token=4)
            unlocked = [leaf for n in tree.nodes() if n.lock_ref == 0
                        for leaf in (*n.exact_leaves.values(), *n.factors.values())]
            held_tokens = tree.leaf_size + sum(-(-leaf.nbytes() // 4) for n in tree.nodes()
                                               for leaf in n.factors.values())
            assert held_tokens <= op[1] or not unlocked
        elif op[0] == "trim":
            held = {n for locked, _ in locks for n in _path_nodes(locked)}
            before = {id(n): {a: leaf.slots.tolist() for a, leaf in n.exact_leaves.items()}
                      for n in held}
            tree.trim_leaves(op[1])
            unlocked_leaves = sum(n.exact_leaf_tokens for n in tree.nodes() if n not in held)
            assert tree.leaf_size <= op[1] or unlocked_leaves == 0
            for n in held:  # the leaves of nodes a request reads stay as they were
                assert {a: leaf.slots.tolist() for a, leaf in n.exact_leaves.items()} == before[id(n)]
        elif op[0] == "evict":
            tree.evict(op[1])
        elif op[0] == "drop":
            # an anchor may be dropped only when no lock reads through it (the radix tree's rule)
            a = anchors[op[1]]
            if not any(id(a) in {id(x) for x in _path_anchors(n)} for n, _ in locks):
                tree.drop_anchor(a)

        # invariants
        assert len(freed) == len(set(freed)), "a slot was freed twice"
        for node, key in locks:
            assert node.alive
            got = SharedTree.path_slots(node).tolist()
            assert got == [truth[key[: i + 1]] for i in range(len(key))]
            assert not set(got) & set(freed), "a locked slot was freed"
        live = list(tree.nodes())
        assert tree.owned_size == sum(n.owned_tokens for n in live)
        assert tree.leaf_size == sum(n.exact_leaf_tokens for n in live)
        assert tree.check_invariants() == []
        for n in live:
            for leaf in n.exact_leaves.values():
                assert not set(leaf.slots.tolist()) & set(freed), "a leaf's slot was freed"
        assert 0 <= tree.owned_locked_size <= tree.owned_size
        assert all(n.lock_ref >= 0 for n in live)
        for n in live:  # every factored token keeps its own factors, however nodes split
            prefix = [t for p in SharedTree.path(n) for t in p.node.key][: -len(n)]
            for agent, leaf in n.factors.items():
                for part in leaf.parts:
                    for o, c in zip(part.offsets.tolist(), part.factors.k[0, :, 0, 0].tolist()):
                        assert factored[(agent, tuple(prefix + list(n.key[: o + 1])))] == c
        for n in live:  # every live token's slot is what was inserted for its token path
            path = [t for p in SharedTree.path(n) for t in p.node.key]
            slots = SharedTree.path_slots(n).tolist()
            assert slots == [truth[tuple(path[: i + 1])] for i in range(len(path))]
            assert not set(n.slots.tolist()) & set(freed)


def _path_nodes(node):
    return [p.node for p in SharedTree.path(node)]


def _path_anchors(node):
    return [p.node.anchor for p in SharedTree.path(node) if p.node.anchor is not None]


def test_match_is_by_tokens_and_namespaced():
    tree = SharedTree(lambda s: None)
    tree.insert(("x", None), [5, 6, 7], 0, torch.tensor([1, 2, 3]), "a", 40, None)
    assert tree.match(("x", None), [5, 6, 9], split=False)[0] == 2
    assert tree.match(("x", "salt"), [5, 6, 7], split=False)[0] == 0
    n, node = tree.match(("x", None), [5, 6], split=True)
    assert n == 2 and node.owner_start == 40 and node.slots.tolist() == [1, 2]
    assert node.children[7].owner_start == 42


def test_invariants_hold_through_insert_lock_evict_and_catch_drift():
    from sglang_kvcmas.tree.shared_tree import SharedTree

    freed = []
    tree = SharedTree(lambda s: freed.extend(s.tolist()))
    _, a = tree.insert("ns", [1, 2, 3, 4], 0, torch.arange(4), "a", 5, anchor=None)
    _, b = tree.insert("ns", [1, 2, 3, 4, 5, 6], 4, torch.arange(10, 12), "b", 9, anchor=None)
    tree.add_overrides(a, "b", torch.tensor([0, 1]), torch.tensor([20, 21]), 7)
    tree.lock(b)
    assert tree.check_invariants() == []
    tree.unlock(b)
    assert tree.evict(100) == 8 and tree.check_invariants() == []
    _, c = tree.insert("ns", [7, 8], 0, torch.arange(30, 32), "a", 0, anchor=None)
    tree.owned_size += 1  # a bookkeeping drift
    assert any("owned_size" in p for p in tree.check_invariants())

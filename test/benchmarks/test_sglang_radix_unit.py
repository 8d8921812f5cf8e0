"""The harness that runs SGLang's radix-cache unit tests against our tree cache (sharing off),
on a small module of the same form (SGLang's copy is fetched by hand, never kept here)."""

from __future__ import annotations

from helpers.bench_scripts import load_script

sru = load_script("benchmark/serving/sglang_radix_unit.py")

MODULE = '''
import unittest
import torch
from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey


class TestLike(unittest.TestCase):
    def test_insert_and_match(self):
        for page_size in (1, 2):
            with self.subTest(page_size=page_size):
                cache = RadixCache.create_simulated(page_size=page_size)
                cache.insert(InsertParams(key=RadixKey([1, 2, 3, 4]),
                                          value=torch.tensor([10, 20, 30, 40])))
                got = cache.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3, 9])))
                self.assertEqual(got.device_prefix_len, 2 if page_size == 2 else 3)

    def test_which_class(self):
        self.assertTrue(RadixCache.create_simulated().__class__.__name__ == "RadixCache")

    def test_drifted_api(self):
        RadixCache.create_simulated().no_such_method()
'''


def test_both_runs_agree_where_the_class_does_not_matter(tmp_path):
    path = tmp_path / "test_like.py"
    path.write_text(MODULE)
    stock, ours = sru.run(path, ours=False), sru.run(path, ours=True)
    assert ours["TestLike.test_which_class"]["outcome"] == "fail"  # really our class
    assert stock["TestLike.test_which_class"]["outcome"] == "pass"
    out = sru.compare(stock, ours)
    assert out["differing"] == ["TestLike.test_which_class"]
    assert out["rows"]["TestLike.test_insert_and_match (page_size=2)"]["ours"] == "pass"
    assert "AttributeError" in out["not_applicable"]["TestLike.test_drifted_api"]
    assert out["tests"] == 5 and out["stock_passed"] == 4 and out["ours_passed"] == 3

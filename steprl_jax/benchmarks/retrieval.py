"""Retrieval benchmark: does BM25 search find HotPotQA's supporting paragraphs?

    python -m steprl_jax.benchmarks.retrieval --data ../shared/data/hotpotqa/dev_400.jsonl

Corpus: the union of all context paragraphs of the file. For each question, recall@k is
the share of its supporting paragraphs among the top k (averaged over questions); "any@k"
is the share of questions with at least one supporting paragraph in the top k. Also prints
index build and query times, and the cached-load time against the build time.
"""
from __future__ import annotations

import argparse
import tempfile
import time

from steprl_jax.data.hotpotqa import load_hotpotqa
from steprl_jax.tools.search import BM25Search, Passage, passages_from_hotpotqa


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="../shared/data/hotpotqa/dev_400.jsonl")
    parser.add_argument("--cache", default=None, help="index cache folder (default: a temporary one)")
    args = parser.parse_args()
    cache = args.cache or tempfile.mkdtemp(prefix="bm25-bench-")
    examples = load_hotpotqa(args.data)
    passages = passages_from_hotpotqa(args.data)
    start = time.perf_counter()
    index = BM25Search.build(passages, cache_root=cache)
    build_s = time.perf_counter() - start
    start = time.perf_counter()
    BM25Search.build(passages, cache_root=cache)
    load_s = time.perf_counter() - start
    ks = (1, 5)
    recall = {k: 0.0 for k in ks}
    any_hit = {k: 0 for k in ks}
    start = time.perf_counter()
    for ex in examples:
        gold = {Passage(p.title, p.text) for p in ex.paragraphs if p.is_supporting}
        hits = [h.passage for h in index.search(ex.question, max(ks))]
        for k in ks:
            found = len(gold & set(hits[:k]))
            recall[k] += found / len(gold)
            any_hit[k] += found > 0
    query_ms = 1000 * (time.perf_counter() - start) / len(examples)
    n = len(examples)
    print(f"questions {n}, passages {len(passages)}")
    print("| metric | @1 | @5 |\n|---|---|---|")
    print(f"| recall (supporting paragraphs found) | {recall[1] / n:.3f} | {recall[5] / n:.3f} |")
    print(f"| any supporting paragraph found | {any_hit[1] / n:.3f} | {any_hit[5] / n:.3f} |")
    print(f"index build {build_s:.2f} s, cached load {load_s:.2f} s (ratio {build_s / max(load_s, 1e-9):.1f}x), "
          f"{query_ms:.2f} ms per query")


if __name__ == "__main__":
    main()

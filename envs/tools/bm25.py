"""Okapi BM25 over a fixed list of documents (Robertson & Zaragoza 2009, eq. 3.5 with the +1 idf).

index = BM25(["red cotton t-shirt", "blue wool socks"])
index.top_k("red shirt", k=1)  # -> [(0, score)]
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict

_TOKEN_RE = re.compile(r"[a-z0-9]+")


def tokenize(text: str) -> list[str]:
    """Lower-case alphanumeric runs."""
    return _TOKEN_RE.findall(text.lower())


class BM25:
    """score(q, d) = sum_t idf(t) * f(t,d) (k1+1) / (f(t,d) + k1 (1 - b + b |d| / avgdl)),
    idf(t) = ln(1 + (N - n_t + 0.5) / (n_t + 0.5)); an inverted index keeps a query O(postings)."""

    def __init__(self, docs: list[str], k1: float = 1.5, b: float = 0.75):
        self.k1, self.b = k1, b
        self.n_docs = len(docs)
        self._postings: dict[str, list[tuple[int, int]]] = defaultdict(list)
        self._lengths = []
        for i, doc in enumerate(docs):
            counts = Counter(tokenize(doc))
            self._lengths.append(sum(counts.values()))
            for term, tf in counts.items():
                self._postings[term].append((i, tf))
        self._avgdl = (sum(self._lengths) / self.n_docs) if self.n_docs else 0.0

    def idf(self, term: str) -> float:
        n_t = len(self._postings.get(term, ()))
        return math.log(1.0 + (self.n_docs - n_t + 0.5) / (n_t + 0.5))

    def scores(self, query: str) -> dict[int, float]:
        """Document index -> score, for documents sharing at least one term with the query."""
        out: dict[int, float] = defaultdict(float)
        for term in set(tokenize(query)):
            postings = self._postings.get(term)
            if not postings:
                continue
            idf = self.idf(term)
            for i, tf in postings:
                norm = self.k1 * (1 - self.b + self.b * self._lengths[i] / self._avgdl)
                out[i] += idf * tf * (self.k1 + 1) / (tf + norm)
        return out

    def top_k(self, query: str, k: int) -> list[tuple[int, float]]:
        """The k best (index, score), best first; ties broken by index so results are deterministic."""
        ranked = sorted(self.scores(query).items(), key=lambda item: (-item[1], item[0]))
        return ranked[:k]

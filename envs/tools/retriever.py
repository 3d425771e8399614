"""A generated encyclopedia of fictional towns, questions about it, and a BM25 retriever served over
loopback HTTP in the Search-R1 format that skyrl-gym's `search` env calls.

    server = acquire_server(corpus_seed=0)   # shared per process and corpus, reference-counted
    server.url                                # http://127.0.0.1:<free port>/retrieve
    release_server(server)

POST /retrieve {"query": str, "topk": int} -> {"result": [[{"document": {"contents": str}, "score": float}]]}.
"""

from __future__ import annotations

import json
import random
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from envs.tools.bm25 import BM25

_SYLLABLES = ["ka", "lo", "ven", "tor", "mi", "sa", "rud", "el", "qua", "bri", "no", "dar", "fen", "ost", "ul", "zy"]
_EXPORTS = ["copper", "wool", "salt", "amber", "tea", "glass", "timber", "honey", "silk", "iron"]
_PROVINCES = ["Northmarch", "Greywater", "Sunreach", "Emberlow", "Frosthold", "Tidewell"]


@dataclass(frozen=True)
class Town:
    name: str
    province: str
    founded: int
    founder: str
    export: str
    river: str


@dataclass(frozen=True)
class SearchTask:
    question: str
    answers: list[str]
    town: str
    doc_index: int


def _word(rng: random.Random, parts: int) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(parts)).capitalize()


def make_corpus(corpus_seed: int = 0, n_towns: int = 300) -> list[Town]:
    """The towns of corpus `corpus_seed`, with distinct names."""
    rng = random.Random(f"towns-{corpus_seed}")
    towns, names = [], set()
    while len(towns) < n_towns:
        name = _word(rng, 3)
        if name in names:
            continue
        names.add(name)
        towns.append(
            Town(
                name,
                rng.choice(_PROVINCES),
                rng.randint(1100, 1900),
                f"{_word(rng, 2)} {_word(rng, 2)}",
                rng.choice(_EXPORTS),
                f"{_word(rng, 2)} River",
            )
        )
    return towns


def document(town: Town) -> str:
    return (
        f'"{town.name}"\n{town.name} is a town in the province of {town.province}, on the banks of the '
        f"{town.river}. It was founded in {town.founded} by {town.founder}. Its main export is {town.export}."
    )


def make_task(seed: int, towns: list[Town]) -> SearchTask:
    """A question about one town (a pure function of the seed and the corpus)."""
    rng = random.Random(f"search-{seed}")
    i = rng.randrange(len(towns))
    town = towns[i]
    question, answer = rng.choice(
        [
            (f"In which year was {town.name} founded?", str(town.founded)),
            (f"Who founded the town of {town.name}?", town.founder),
            (f"What is the main export of {town.name}?", town.export),
            (f"In which province is {town.name}?", town.province),
            (f"On which river does {town.name} lie?", town.river),
        ]
    )
    return SearchTask(question, [answer], town.name, i)


class RetrieverServer:
    """BM25 over one corpus behind a ThreadingHTTPServer on 127.0.0.1 (a free port), in a daemon thread."""

    def __init__(self, docs: list[str]):
        self.docs = docs
        self.index = BM25(docs)
        self.refs = 0
        index, texts = self.index, docs

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                try:
                    body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                    hits = index.top_k(str(body.get("query", "")), int(body.get("topk", 3)))
                    result = [[{"document": {"contents": texts[i]}, "score": s} for i, s in hits]]
                    payload, status = json.dumps({"result": result}).encode(), 200
                except (ValueError, TypeError) as exc:
                    payload, status = json.dumps({"error": str(exc)}).encode(), 400
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args) -> None:  # one line per request would flood the actor's log
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}/retrieve"
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="bm25-retriever", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


_servers: dict[tuple[int, int], RetrieverServer] = {}
_lock = threading.Lock()


def acquire_server(corpus_seed: int = 0, n_towns: int = 300) -> RetrieverServer:
    """The process's server for this corpus, started on first use; pair every call with `release_server`."""
    with _lock:
        key = (corpus_seed, n_towns)
        server = _servers.get(key)
        if server is None:
            server = RetrieverServer([document(t) for t in make_corpus(corpus_seed, n_towns)])
            server.start()
            _servers[key] = server
        server.refs += 1
        return server


def release_server(server: RetrieverServer) -> None:
    """Drop one reference; the last one stops the server."""
    with _lock:
        server.refs -= 1
        if server.refs <= 0:
            server.close()
            _servers.pop(next((k for k, v in _servers.items() if v is server), None), None)

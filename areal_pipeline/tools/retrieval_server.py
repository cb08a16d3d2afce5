"""Local retrieval server for the search agent, with the JSON of AReaL/ASearcher's `/retrieve`.

    areal-pipeline retrieval-server --corpus corpus.jsonl --host 127.0.0.1 --port 8000

    POST /retrieve {"queries": ["capital of France"], "topk": 3, "return_scores": false}
      -> {"result": [[{"id", "title", "contents"}, ...]]}       (with scores: [{"document": doc, "score": s}])
    GET /health -> {"status": "ok", "retriever": "bm25", "num_docs": N}

A document is the corpus row as it is (jsonl with `id`, `title`, `contents`). Without `--corpus` the server
serves the generated knowledge base (`areal_pipeline.data.knowledge_base`). BM25 (bm25s, English stemming
and stop words) is the default; `--retriever dense --embedding-model DIR` embeds with a local transformers
model (mean pooling, cosine). The index is built once and kept under `--index-dir` (by default the user's
cache, `$XDG_CACHE_HOME/areal-pipeline/indexes`; a run's launcher uses `<output_dir>/_indexes`), keyed by the
corpus content digest (and, for dense, the model's), so restarts and other runs on the same corpus load it.
Bad requests get HTTP 400 `{"error": {"message": ...}}`, a body that is not JSON 415, and one over
`--max-body-bytes` or with more than `--max-queries` queries 413: searches run one at a time, and these bound
how long one request can keep the others waiting. Results only hold documents that share a term with the
query (BM25) rather than filling `topk` with arbitrary ones.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

import numpy as np
from aiohttp import hdrs, web

from areal_pipeline.auth import CredentialError, authorized, server_ssl_context, service_token
from areal_pipeline.http_json import (
    RequestRejected,
    bearer_auth,
    check_bool,
    check_int,
    json_errors,
    read_json,
    shown,
)
from areal_pipeline.processes import ServerProcess
from areal_pipeline.tools.retrieval_args import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_QUERIES,
    RETRIEVERS,
    build_arg_parser,
    default_index_dir,
)
from areal_pipeline.utils import atomic_directory, atomic_path, exit_when_parent_dies, find_free_port, get_logger

logger = get_logger(__name__)

REQUEST_KEYS = {"queries", "topk", "return_scores"}

# A request the server answers with HTTP 400 (413 when it is too big).
BadRequest = RequestRejected


# ---------------------------------------------------------------------------------------------- corpus


def load_corpus(path: Optional[str]) -> tuple[list[dict[str, Any]], str]:
    """(rows, sha256 of the corpus content); `path` None or empty: the generated knowledge base."""
    if not path:
        from areal_pipeline.data.knowledge_base import knowledge_base

        rows = knowledge_base().corpus
        data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()
        return rows, hashlib.sha256(data).hexdigest()
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"retrieval corpus not found: {file}")
    data = file.read_bytes()
    rows = []
    for lineno, line in enumerate(data.decode("utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{file}, line {lineno}: invalid JSON ({e.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("contents"), str):
            raise ValueError(f"{file}, line {lineno}: expected an object with a string 'contents' "
                             "(and 'id', 'title')")
        rows.append(row)
    if not rows:
        raise ValueError(f"retrieval corpus {file} has no documents")
    return rows, hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------------------------------------- retrievers


class BM25Retriever:
    name = "bm25"

    def __init__(self, texts: list[str], index_dir: Path):
        import bm25s
        import Stemmer

        self._bm25s = bm25s
        self._stemmer = Stemmer.Stemmer("english")
        if not (index_dir / "params.index.json").is_file():
            logger.info("building the BM25 index of %d documents in %s", len(texts), index_dir)
            index = bm25s.BM25()
            index.index(self._tokenize(texts), show_progress=False)
            with atomic_directory(index_dir) as tmp:
                index.save(tmp, show_progress=False)
        self.index = bm25s.BM25.load(index_dir, show_progress=False)
        self.num_docs = len(texts)

    def _tokenize(self, texts: list[str]):
        return self._bm25s.tokenize(texts, stopwords="en", stemmer=self._stemmer, show_progress=False)

    def search(self, queries: list[str], k: int) -> list[list[tuple[int, float]]]:
        vocab = self.index.vocab_dict
        tokens = self._bm25s.tokenize(queries, stopwords="en", stemmer=self._stemmer, return_ids=False,
                                      show_progress=False)
        # A query with no indexed term would score every document 0: it finds nothing.
        known = [[t for t in q if t in vocab] for q in tokens]
        results: list[list[tuple[int, float]]] = [[] for _ in queries]
        asked = [i for i, q in enumerate(known) if q]
        if asked:
            docs, scores = self.index.retrieve([known[i] for i in asked], k=min(k, self.num_docs),
                                               show_progress=False, n_threads=1)
            for i, row_docs, row_scores in zip(asked, docs.tolist(), scores.tolist()):
                results[i] = [(d, s) for d, s in zip(row_docs, row_scores) if s > 0]
        return results


class DenseRetriever:
    """Cosine similarity of mean-pooled embeddings from a local transformers encoder."""

    name = "dense"
    BATCH = 32
    MAX_LENGTH = 256

    def __init__(self, texts: list[str], model_dir: str, index_dir: Path):
        import torch
        from transformers import AutoModel, AutoTokenizer

        self._torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModel.from_pretrained(model_dir).eval()
        path = index_dir / "embeddings.npy"
        if not path.is_file():
            logger.info("embedding %d documents with %s into %s", len(texts), model_dir, path)
            embeddings = np.concatenate([self._encode(texts[i:i + self.BATCH])
                                         for i in range(0, len(texts), self.BATCH)])
            path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_path(path) as tmp, open(tmp, "wb") as f:
                np.save(f, embeddings)
        self.embeddings = np.load(path)
        self.num_docs = len(texts)

    def _encode(self, texts: list[str]) -> np.ndarray:
        batch = self.tokenizer(texts, padding=True, truncation=True, max_length=self.MAX_LENGTH, return_tensors="pt")
        with self._torch.no_grad():
            hidden = self.model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)
        return self._torch.nn.functional.normalize(pooled, dim=-1).float().numpy()

    def search(self, queries: list[str], k: int) -> list[list[tuple[int, float]]]:
        scores = self._encode(queries) @ self.embeddings.T
        k = min(k, self.num_docs)
        top = np.argsort(-scores, axis=1, kind="stable")[:, :k]
        return [[(int(d), float(row[d])) for d in docs] for row, docs in zip(scores, top)]


def _directory_digest(path: str) -> str:
    h = hashlib.sha256()
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"embedding model directory not found: {root} (retriever=dense needs a local one)")
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        h.update(str(file.relative_to(root)).encode())
        h.update(file.read_bytes())
    return h.hexdigest()


def build_retriever(rows: list[dict[str, Any]], digest: str, retriever: str, index_root: Path,
                    embedding_model: str = ""):
    texts = [row["contents"] for row in rows]
    if retriever == "bm25":
        return BM25Retriever(texts, Path(index_root) / f"bm25-{digest[:16]}")
    if retriever == "dense":
        if not embedding_model:
            raise ValueError("retriever=dense needs an embedding model directory (retrieval.embedding_model)")
        model_digest = _directory_digest(embedding_model)
        return DenseRetriever(texts, embedding_model, Path(index_root) / f"dense-{digest[:16]}-{model_digest[:12]}")
    raise ValueError(f"unknown retriever '{retriever}'; valid: {', '.join(RETRIEVERS)}")


# ---------------------------------------------------------------------------------------------- service


class RetrievalService:
    """Request validation and retrieval, shared by the HTTP server and the in-process client."""

    def __init__(self, rows: list[dict[str, Any]], retriever, *, topk: int = 3, max_topk: int = 50,
                 max_query_chars: int = 2000, max_queries: int = DEFAULT_MAX_QUERIES):
        if not 1 <= topk <= max_topk:
            raise ValueError(f"the default topk must be in [1, max_topk={max_topk}], got {topk}")
        self.rows, self.retriever = rows, retriever
        self.topk, self.max_topk, self.max_query_chars, self.max_queries = topk, max_topk, max_query_chars, max_queries

    @classmethod
    def from_config(cls, rcfg, index_root: Path) -> "RetrievalService":
        """From a `RetrievalConfig`; its `index_dir`, when set, overrides `index_root`."""
        rows, digest = load_corpus(rcfg.corpus)
        retriever = build_retriever(rows, digest, rcfg.retriever, Path(rcfg.index_dir or index_root),
                                    rcfg.embedding_model)
        return cls(rows, retriever, topk=rcfg.topk, max_topk=rcfg.max_topk, max_query_chars=rcfg.max_query_chars,
                   max_queries=rcfg.max_queries)

    def parse(self, body: Any) -> tuple[list[str], int, bool]:
        """(queries, topk, return_scores) of a request body; raises BadRequest."""
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        unknown = sorted(set(body) - REQUEST_KEYS)
        if unknown:
            raise BadRequest(f"unknown field(s) {unknown}; valid: {sorted(REQUEST_KEYS)}")
        queries = body.get("queries")
        if not isinstance(queries, list) or not all(type(q) is str for q in queries):
            raise BadRequest(f"'queries' must be a list of strings, got {shown(queries)}")
        if len(queries) > self.max_queries:
            raise BadRequest(f"{len(queries)} queries in one request; the limit is {self.max_queries}: "
                             "send them in several requests", 413)
        too_long = [i for i, q in enumerate(queries) if len(q) > self.max_query_chars]
        if too_long:
            raise BadRequest(f"query {too_long[0]} has {len(queries[too_long[0]])} characters; "
                             f"the limit is {self.max_query_chars}")
        topk = body.get("topk")
        topk = check_int("topk", self.topk if topk is None else topk, minimum=1, maximum=self.max_topk)
        return_scores = check_bool("return_scores", body.get("return_scores", False))
        return queries, topk, return_scores

    def retrieve(self, body: Any) -> dict[str, Any]:
        """The `/retrieve` reply for a request body; raises BadRequest."""
        return self.search(*self.parse(body))

    def search(self, queries: list[str], topk: int, return_scores: bool) -> dict[str, Any]:
        """The `/retrieve` reply for parsed queries."""
        asked = [i for i, q in enumerate(queries) if q.strip()]
        hits: list[list[tuple[int, float]]] = [[] for _ in queries]
        if asked:
            for i, found in zip(asked, self.retriever.search([queries[i] for i in asked], topk)):
                hits[i] = found
        if return_scores:
            return {"result": [[{"document": self.rows[d], "score": s} for d, s in found] for found in hits]}
        return {"result": [[self.rows[d] for d, _ in found] for found in hits]}


def make_app(service: RetrievalService, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
             token: Optional[str] = None) -> web.Application:
    # One retrieval at a time: the work is CPU-bound, and a dense encoder is not safe to share across threads.
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="retrieve")

    async def retrieve(request: web.Request) -> web.Response:
        # checked here, so that a bad request is answered at once rather than after the searches queued before it
        queries, topk, return_scores = service.parse(await read_json(request))
        reply = await asyncio.get_running_loop().run_in_executor(executor, service.search, queries, topk,
                                                                 return_scores)
        return web.json_response(reply)

    async def health(request: web.Request) -> web.Response:
        if not authorized(request.headers.get(hdrs.AUTHORIZATION), token):  # the bare probe: up, and no more
            return web.json_response({"status": "ok"})
        return web.json_response({"status": "ok", "retriever": service.retriever.name, "num_docs": len(service.rows)})

    async def shutdown(app: web.Application) -> None:
        executor.shutdown(wait=False, cancel_futures=True)

    app = web.Application(client_max_size=max_body_bytes, middlewares=[bearer_auth(token), json_errors])
    app.router.add_post("/retrieve", retrieve)
    app.router.add_get("/health", health)
    app.on_shutdown.append(shutdown)
    return app


# ---------------------------------------------------------------------------------------------- process


def serve(args: argparse.Namespace) -> None:
    try:
        token, ssl_context = service_token("the retrieval server"), server_ssl_context()
    except CredentialError as e:
        raise SystemExit(str(e)) from None
    exit_when_parent_dies()
    rows, digest = load_corpus(args.corpus)
    retriever = build_retriever(rows, digest, args.retriever, Path(args.index_dir or default_index_dir()),
                                args.embedding_model)
    service = RetrievalService(rows, retriever, topk=args.topk, max_topk=args.max_topk,
                               max_query_chars=args.max_query_chars, max_queries=args.max_queries)
    logger.info("retrieval server on %s://%s:%d (%s over %d documents)", "https" if ssl_context else "http",
                args.host, args.port, retriever.name, len(rows))
    web.run_app(make_app(service, args.max_body_bytes, token), host=args.host, port=args.port, print=None,
                access_log=None, shutdown_timeout=1.0, ssl_context=ssl_context)  # a stopped run does not wait for the requests in flight


def retrieval_server_command(cfg, port: int) -> list[str]:
    r = cfg.rollout.agent.retrieval
    cmd = [
        sys.executable, "-m", "areal_pipeline.tools.retrieval_server",
        "--host", r.host,
        "--port", str(port),
        "--retriever", r.retriever,
        "--index-dir", str(r.index_dir or Path(cfg.output_dir) / "_indexes"),
        "--topk", str(r.topk),
        "--max-topk", str(r.max_topk),
        "--max-query-chars", str(r.max_query_chars),
        "--max-queries", str(r.max_queries),
        "--max-body-bytes", str(r.max_body_bytes),
    ]  # fmt: skip
    if r.corpus:
        cmd += ["--corpus", str(r.corpus)]
    if r.embedding_model:
        cmd += ["--embedding-model", str(r.embedding_model)]
    return cmd


def launch_retrieval_server(cfg, log_dir: Path) -> ServerProcess:
    """Start the retrieval server of `cfg.rollout.agent.retrieval` and wait until it answers /health."""
    r = cfg.rollout.agent.retrieval
    port = r.port or find_free_port(r.host)
    server = ServerProcess(retrieval_server_command(cfg, port), f"{r.host}:{port}",
                           Path(log_dir) / "retrieval-server.log", kind="retrieval server")
    server.start()
    try:
        server.wait_healthy(r.setup_timeout)
    except BaseException:
        server.stop()
        raise
    return server


def main(argv: Optional[list[str]] = None) -> None:
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    serve(build_arg_parser().parse_args(argv))


if __name__ == "__main__":
    main()


def start_for_run(cfg, log_dir: Path) -> Optional[ServerProcess]:
    """The retrieval tool of a run (TOOL_SERVERS["retrieval"]): None when `rollout.agent.retrieval.address` names a
    server already running, once it answers (the workflow searches that one), else the run's own server, started."""
    address = cfg.rollout.agent.retrieval.address
    if address:
        from areal_pipeline.tools.retrieval_client import check_retrieval_server

        check_retrieval_server(address)
        return None
    return launch_retrieval_server(cfg, log_dir)

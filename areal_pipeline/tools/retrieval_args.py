"""The retrieval server's command line and defaults, apart from the server so that building the parser of every
subcommand (`areal-pipeline --help`, any command's start) does not import aiohttp, numpy and the retrievers."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

RETRIEVERS = ("bm25", "dense")
DEFAULT_MAX_QUERIES = 256
DEFAULT_MAX_BODY_BYTES = 1 << 20


def default_index_dir() -> Path:
    """Where a retrieval server started on its own keeps its indexes: the user's cache, not the current directory."""
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "areal-pipeline" / "indexes"


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="BM25 (or dense) retrieval server with ASearcher's /retrieve API")
    p.add_argument("--corpus", default="", help="jsonl with id, title, contents (default: the generated KB)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--retriever", default="bm25", choices=RETRIEVERS)
    p.add_argument("--embedding-model", default="", help="local encoder directory, for --retriever dense")
    p.add_argument("--index-dir", default="",
                   help=f"where built indexes are kept (default: {default_index_dir()}, from $XDG_CACHE_HOME)")
    p.add_argument("--topk", type=int, default=3, help="results per query when a request gives no topk")
    p.add_argument("--max-topk", type=int, default=50)
    p.add_argument("--max-query-chars", type=int, default=2000)
    p.add_argument("--max-queries", type=int, default=DEFAULT_MAX_QUERIES, help="queries per request (413 beyond)")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, help="request body size (413 beyond)")
    return p

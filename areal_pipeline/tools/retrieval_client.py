"""Clients of the retrieval server: over HTTP, or the same service in process.

    client = RetrievalClient("127.0.0.1:8000", retries=3)
    docs = await client.retrieve(["capital of France"], topk=3)      # [[{"id", "title", "contents"}, ...]]

Every failure comes out as `RetrievalError`, naming the server (`address`) and, for an error reply, its `status`: the
rollout's failure policy (rollout/failures.py) plays the episode again, unless the server refused the request (4xx).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Optional

import aiohttp

from areal_pipeline import auth

from areal_pipeline.utils import get_logger

logger = get_logger(__name__)


class RetrievalError(RuntimeError):
    def __init__(self, message: str, address: Optional[str] = None, status: Optional[int] = None):
        super().__init__(message)
        self.address, self.status = address, status


class RetrievalClient:
    """`POST /retrieve`; connection errors, timeouts and HTTP 5xx are retried `retries` times, 4xx are not."""

    def __init__(self, address: str, *, retries: int = 3, retry_delay: float = 0.5, timeout: float = 60.0):
        self.address, self.retries, self.retry_delay, self.timeout = address, retries, retry_delay, timeout

    async def retrieve(self, queries: list[str], topk: int) -> list[list[dict[str, Any]]]:
        url = auth.url(self.address, "/retrieve")
        payload = {"queries": queries, "topk": topk, "return_scores": False}
        last_error, status = "", None
        for attempt in range(self.retries + 1):
            if attempt:
                logger.warning("retrieval at %s failed (%s); retry %d/%d", self.address, last_error, attempt,
                               self.retries)
                await asyncio.sleep(self.retry_delay * 2 ** (attempt - 1))
            try:
                # A session per call: searches are rare next to generations, and the workflow has no
                # close hook in which to end a long-lived session.
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout),
                                                 headers=auth.auth_headers()) as session:
                    async with session.post(url, json=payload, ssl=auth.client_ssl_context() or True) as resp:
                        body = await resp.json(content_type=None)
                        if resp.status < 400:
                            return _results(body, len(queries))
                        message = body.get("error", {}).get("message") if isinstance(body, dict) else body
                        last_error, status = f"HTTP {resp.status}: {message}", resp.status
                        if resp.status < 500:
                            break
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
                last_error, status = f"{type(e).__name__}: {e}", None
        raise RetrievalError(f"retrieval server {self.address}: {last_error}", self.address, status)


class LocalRetrievalClient:
    """The retrieval service in this process (a thread), for runs with no retrieval server."""

    def __init__(self, service):
        self.service = service
        # One retrieval at a time, as in the server: a dense encoder is not safe to share across threads.
        self._lock = threading.Lock()

    def _retrieve(self, body: dict) -> dict:
        with self._lock:
            return self.service.retrieve(body)

    async def retrieve(self, queries: list[str], topk: int) -> list[list[dict[str, Any]]]:
        try:
            body = await asyncio.to_thread(self._retrieve, {"queries": queries, "topk": topk})
        except Exception as e:
            raise RetrievalError(f"in-process retrieval: {e}", "in-process") from e
        return body["result"]


def check_retrieval_server(address: str, timeout: float = 10.0) -> None:
    """Raise RetrievalError unless a retrieval server at `address` answers a one-query `/retrieve` (what any
    server of this API has, ASearcher's included; /health is this project's own)."""
    from areal_pipeline.utils import run_async

    try:
        run_async(RetrievalClient(address, retries=0, timeout=timeout).retrieve(["test"], topk=1))
    except RetrievalError as e:
        raise RetrievalError(f"rollout.agent.retrieval.address={address}: no retrieval server answers POST "
                             f"/retrieve there ({e}); start it, or leave the address empty for the run to start "
                             "its own") from None


def _results(body: Any, n: int) -> list[list[dict[str, Any]]]:
    result = body.get("result") if isinstance(body, dict) else None
    if not isinstance(result, list) or len(result) != n:
        raise ValueError(f"expected {{'result': [...]}} with {n} lists, got {str(body)[:200]}")
    return result

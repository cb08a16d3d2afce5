"""An LLM judge as a group reward (RULER's idea, from ART): one chat-completions call shows the judge a prompt's
question, the reference answer where there is one and every answer of its group, and asks for one score per answer
in [0, 1] as JSON, the answers scored relative to each other.

    rollout.group_reward: judge
    judge: {base_url: https://api.example.com/v1, model: some-judge, api_key_env: JUDGE_API_KEY}

Any OpenAI-compatible endpoint serves: the project's server, vLLM, a hosted API (its key read from the environment
variable `judge.api_key_env` names). A judge the run serves itself (`judge.serve`, rewards/local_judge.py) is one of
the run's services: it is sent the run's token (areal_pipeline/auth.py) instead. Each call

- is looked up first in a cache on disk keyed by a content hash (the model, the messages, the sampling settings):
  a rerun, a retried rollout node or `areal-pipeline rescore` asks again for nothing it already asked;
- holds a slot of a limiter around the HTTP call: a local semaphore of `judge.max_concurrency` by default, a Prefect
  global concurrency limit that every run on one Prefect server shares for a judge built while the Prefect layer
  has one installed (`limiter_installed`: tasks/judge_limit.py, for a run or a re-scoring);
- is retried on transient faults (no connection, a timeout, 429 after its Retry-After, 5xx) and on an answer that
  is no valid scores JSON (wrong count, not numbers, out of range), every wait bounded. When the retries run out it
  raises JudgeUnavailable, naming the endpoint and the last cause: a transient error, which the rollout's failure
  policy takes as a failure of the group (rollout/judging.py), never a made-up score.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
import os
import re
import ssl
import threading
import weakref
from pathlib import Path
from typing import Any, AsyncContextManager, Callable, Iterator, Optional
from urllib.parse import urlparse

from areal_pipeline.errors import PermanentError
from areal_pipeline.rewards.group import Candidate
from areal_pipeline.utils import atomic_write_text, get_logger

logger = get_logger(__name__)

# A limiter factory: (limit name, slots, seconds to wait for one) -> an async context manager held around one call.
LimiterFactory = Callable[[str, int, float], AsyncContextManager]
# the factories of the `limiter_installed` blocks open now, the newest last (two runs of one process overlap)
_installed_limiters: list[LimiterFactory] = []
_installed_limiters_lock = threading.Lock()

SYSTEM_PROMPT = (
    "You are a strict grader. You are given a question, possibly its reference answer, and several candidate "
    "answers to it. Score every candidate from 0 to 1: 1 for a fully correct answer, 0 for a wrong or missing one, "
    "in between for partial credit, comparing the candidates with each other. Reply with JSON only, in the form "
    '{"scores": [s1, s2, ...]}, one number per candidate in their order.')


class JudgeUnavailable(ConnectionError):
    """The judge gave no valid answer within its retries: transient (errors.is_transient), never a score of 0.
    `peer`: the endpoint (what the rollout's failure records name)."""

    def __init__(self, message: str, peer: Optional[str] = None):
        super().__init__(message)
        self.peer = peer


class JudgeRefused(PermanentError):
    """The judge's endpoint refused the request itself (a 4xx but 408/409/425/429: a wrong key, an unknown model):
    the same request is refused again, so the node is not retried."""


class JudgeAnswerError(ValueError):
    """An answer of the judge that is no valid scores JSON for its group."""


class JudgeHTTPError(Exception):
    """An error reply of the judge's endpoint (`status` as errors.is_transient reads it)."""

    def __init__(self, status: int, body: str, retry_after: Optional[float] = None):
        super().__init__(f"HTTP {status}: {body[:300]}")
        self.status, self.retry_after = status, retry_after


@contextlib.contextmanager
def limiter_installed(factory: LimiterFactory) -> Iterator[None]:
    """Every judge built in the block holds a slot of `factory(name, slots, wait_s)` around each of its calls (the
    Prefect layer installs its global concurrency limit for a run or a re-scoring); once no such block is open, a
    judge built keeps a local semaphore of its own. Blocks may overlap: the newest open one's factory is used."""
    with _installed_limiters_lock:
        _installed_limiters.append(factory)
    try:
        yield
    finally:
        with _installed_limiters_lock:
            _installed_limiters.remove(factory)


def installed_limiter() -> Optional[LimiterFactory]:
    """The factory a judge built now takes (`limiter_installed`); None: its own local semaphore."""
    with _installed_limiters_lock:
        return _installed_limiters[-1] if _installed_limiters else None


def default_limit_name(base_url: str) -> str:
    """The shared limit's name where `judge.limit_name` is empty: one per endpoint host."""
    host = urlparse(base_url).hostname or "local"
    return "judge-" + re.sub(r"[^A-Za-z0-9_.-]", "-", host)


def judge_messages(candidates: list[Candidate], include_reference: bool = True) -> list[dict[str, str]]:
    """The chat of one group's judge call."""
    first = candidates[0]
    parts = [f"Question:\n{first.question}"]
    if include_reference and first.answer not in (None, ""):
        parts.append(f"Reference answer:\n{first.answer}")
    for i, candidate in enumerate(candidates, 1):
        parts.append(f"Candidate {i}:\n{candidate.completion}")
    parts.append(f'Reply with {{"scores": [...]}}: exactly {len(candidates)} numbers in [0, 1].')
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "\n\n".join(parts)}]


def parse_scores(text: str, n: int) -> list[float]:
    """The judge's answer `text` as `n` scores in [0, 1]: a JSON object {"scores": [...]} (a ```json fence around
    it allowed), else JudgeAnswerError saying what is wrong."""
    body = text.strip()
    fenced = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", body, re.DOTALL)
    if fenced:
        body = fenced.group(1)
    try:
        answer = json.loads(body)
    except ValueError:
        raise JudgeAnswerError(f"the judge's answer is not JSON: {text[:200]!r}") from None
    if not isinstance(answer, dict) or not isinstance(answer.get("scores"), list):
        raise JudgeAnswerError(f'the judge\'s answer is no {{"scores": [...]}} object: {text[:200]!r}')
    scores = answer["scores"]
    if len(scores) != n:
        raise JudgeAnswerError(f"the judge gave {len(scores)} scores for {n} candidates: {text[:200]!r}")
    for score in scores:
        if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
            raise JudgeAnswerError(f"the judge's score {score!r} is not a number: {text[:200]!r}")
        if not 0 <= score <= 1:
            raise JudgeAnswerError(f"the judge's score {score!r} is outside [0, 1]: {text[:200]!r}")
    return [float(score) for score in scores]


def cache_key(model: str, messages: list[dict[str, str]], sampling: dict[str, Any]) -> str:
    """The content hash of one judge request: the same question asked again is the same key."""
    what = json.dumps({"model": model, "messages": messages, "sampling": sampling}, sort_keys=True)
    return hashlib.sha256(what.encode()).hexdigest()


class JudgeCache:
    """Judged groups on disk: one small JSON file per content hash, written atomically (concurrent runs sharing the
    directory at worst ask the same question twice)."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)

    def path(self, key: str) -> Path:
        return self.directory / key[:2] / f"{key}.json"

    def get(self, key: str) -> Optional[dict[str, Any]]:
        try:
            return json.loads(self.path(key).read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as error:  # unreadable: asked again, and written anew
            logger.warning("judge cache: %s is unusable (%s): asking the judge again", self.path(key), error)
            return None

    def put(self, key: str, entry: dict[str, Any]) -> None:
        self.path(key).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.path(key), json.dumps(entry, sort_keys=True))


def _retry_after(value: Optional[str]) -> Optional[float]:
    try:
        return max(0.0, float(value)) if value else None
    except ValueError:  # an HTTP date: the doubling delay instead
        return None


class Judge:
    """The judge group reward (GroupReward, rewards/group.py) of a `judge` config section."""

    def __init__(self, judge_cfg: Any, cache_dir: Path, *, api_key: Optional[str] = None,
                 limiter: Optional[LimiterFactory] = None, ssl_context: Optional[ssl.SSLContext] = None):
        """`api_key`: sent as `Authorization: Bearer` (None: nothing sent); `ssl_context`: what an https endpoint's
        certificate is checked against (None: the system's CAs)."""
        self.cfg = judge_cfg
        if not judge_cfg.base_url or not judge_cfg.model:
            raise ValueError("judge.base_url and judge.model: the judge needs both (areal_pipeline/rewards/judge.py)")
        self.url = judge_cfg.base_url.rstrip("/") + "/chat/completions"
        self.api_key = api_key
        self.ssl_context = ssl_context
        self.cache = JudgeCache(cache_dir)
        self.limit_name = judge_cfg.limit_name or default_limit_name(judge_cfg.base_url)
        self._limiter = limiter or installed_limiter() or self._local_limiter
        self._semaphores: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore]" = (
            weakref.WeakKeyDictionary())
        self._lock = threading.Lock()
        self._usage = self._no_usage()

    # ----- GroupReward --------------------------------------------------------------------------------
    async def score_group(self, candidates: list[Candidate]) -> list[float]:
        if not candidates:
            return []
        messages = judge_messages(candidates, self.cfg.include_reference)
        sampling = {"temperature": self.cfg.temperature, "max_tokens": self.cfg.max_tokens}
        key = cache_key(self.cfg.model, messages, sampling)
        cached = await asyncio.to_thread(self.cache.get, key)
        if cached is not None and len(cached.get("scores", ())) == len(candidates):
            self._count(cache_hits=1)
            return [float(s) for s in cached["scores"]]
        scores, usage = await self._ask(messages, sampling, len(candidates))
        await asyncio.to_thread(self.cache.put, key, {"scores": scores, "usage": usage, "model": self.cfg.model})
        return scores

    def take_usage(self) -> dict[str, float]:
        with self._lock:
            usage, self._usage = self._usage, self._no_usage()
        return usage

    async def aclose(self) -> None:
        """Nothing held between calls: each call opens and closes its own connection."""

    # ----- the call -------------------------------------------------------------------------------------
    async def _ask(self, messages: list[dict[str, str]], sampling: dict[str, Any], n: int
                   ) -> tuple[list[float], dict[str, int]]:
        from areal_pipeline.errors import is_transient

        last: Optional[BaseException] = None
        for attempt in range(self.cfg.retries + 1):
            delay = self.cfg.retry_delay * 2 ** attempt
            try:
                async with self._limiter(self.limit_name, self.cfg.max_concurrency, self.cfg.slot_timeout):
                    reply = await self._post({"model": self.cfg.model, "messages": messages, **sampling})
                usage = reply.get("usage") or {}
                self._count(calls=1, prompt_tokens=int(usage.get("prompt_tokens", 0)),
                            completion_tokens=int(usage.get("completion_tokens", 0)))
                text = reply["choices"][0]["message"]["content"] or ""
                return parse_scores(text, n), {k: int(usage.get(k, 0)) for k in ("prompt_tokens",
                                                                                   "completion_tokens")}
            except (JudgeAnswerError, KeyError, IndexError, TypeError) as error:
                last = error if isinstance(error, JudgeAnswerError) else JudgeAnswerError(
                    f"the judge's reply is no chat completion: {type(error).__name__}: {error}")
            except JudgeHTTPError as error:
                if not is_transient(error):
                    raise JudgeRefused(f"the judge at {self.url} (model {self.cfg.model}) refused the request: "
                                       f"{error}") from None
                last = error
                delay = max(delay, error.retry_after or 0.0)
            except asyncio.CancelledError:
                raise
            except Exception as error:  # no connection, a timeout, a slot not granted in time
                if not is_transient(error):
                    raise
                last = error
            if attempt < self.cfg.retries:
                logger.warning("judge at %s: attempt %d of %d failed (%s: %s); again in %.3g s", self.url,
                               attempt + 1, self.cfg.retries + 1, type(last).__name__, last, delay)
                await asyncio.sleep(delay)
        raise JudgeUnavailable(f"the judge at {self.url} (model {self.cfg.model}) gave no valid answer in "
                               f"{self.cfg.retries + 1} attempt(s); the last: {type(last).__name__}: {last}",
                               peer=self.url) from last

    async def _post(self, body: dict[str, Any]) -> dict[str, Any]:
        import aiohttp

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        timeout = aiohttp.ClientTimeout(total=self.cfg.timeout)
        try:
            async with aiohttp.ClientSession(timeout=timeout) as session:
                async with session.post(self.url, json=body, headers=headers,
                                        **({"ssl": self.ssl_context} if self.ssl_context is not None else {})
                                        ) as response:
                    text = await response.text()
                    if response.status >= 400:
                        raise JudgeHTTPError(response.status, text, _retry_after(response.headers.get("Retry-After")))
        except asyncio.TimeoutError:
            raise TimeoutError(f"no answer within judge.timeout={self.cfg.timeout:g} s") from None
        except aiohttp.ClientError as error:
            raise ConnectionError(f"{type(error).__name__}: {error}") from None
        try:
            return json.loads(text)
        except ValueError:
            raise JudgeAnswerError(f"the judge's reply is not JSON: {text[:200]!r}") from None

    def _local_limiter(self, name: str, slots: int, wait_s: float) -> AsyncContextManager:
        loop = asyncio.get_running_loop()
        semaphore = self._semaphores.get(loop)
        if semaphore is None:
            semaphore = self._semaphores[loop] = asyncio.Semaphore(slots)
        return _slot(semaphore, name, wait_s)

    # ----- usage ------------------------------------------------------------------------------------------
    @staticmethod
    def _no_usage() -> dict[str, float]:
        return {"judge/calls": 0, "judge/cache_hits": 0, "judge/prompt_tokens": 0, "judge/completion_tokens": 0,
                "judge/cost_usd": 0.0}

    def _count(self, calls: int = 0, cache_hits: int = 0, prompt_tokens: int = 0, completion_tokens: int = 0) -> None:
        cost = (prompt_tokens * self.cfg.prompt_price_per_mtok
                + completion_tokens * self.cfg.completion_price_per_mtok) / 1e6
        with self._lock:
            for name, value in (("calls", calls), ("cache_hits", cache_hits), ("prompt_tokens", prompt_tokens),
                                ("completion_tokens", completion_tokens), ("cost_usd", cost)):
                self._usage[f"judge/{name}"] += value


@contextlib.asynccontextmanager
async def _slot(semaphore: asyncio.Semaphore, name: str, wait_s: float):
    try:
        async with asyncio.timeout(wait_s):
            await semaphore.acquire()
    except TimeoutError:
        raise TimeoutError(f"no slot of the judge limit {name!r} within judge.slot_timeout={wait_s:g} s") from None
    try:
        yield
    finally:
        semaphore.release()


def judge_cache_dir(cfg: Any) -> Path:
    return Path(cfg.judge.cache_dir) if cfg.judge.cache_dir else Path(cfg.output_dir) / "judge_cache"


def judge(cfg: Any) -> Judge:
    """The `rollout.group_reward: judge` builder: the judge of the run's config `cfg` (its `judge` section). A judge
    the run serves (judge.serve) demands the run's token, as every service of the run does; an external one is sent
    the key in the environment variable judge.api_key_env names, or nothing."""
    if cfg.judge.serve:
        from areal_pipeline import auth

        return Judge(cfg.judge, judge_cache_dir(cfg), api_key=auth.run_token(), ssl_context=auth.client_ssl_context())
    name = cfg.judge.api_key_env
    api_key = None
    if name:
        api_key = os.environ.get(name)
        if not api_key:
            raise ValueError(f"judge.api_key_env={name}: the environment variable {name} is not set (it holds the "
                             "judge endpoint's API key)")
    return Judge(cfg.judge, judge_cache_dir(cfg), api_key=api_key)

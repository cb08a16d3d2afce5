"""A real aiohttp server speaking OpenAI's chat-completions API as a hosted judge endpoint does, for the judge tests:
it grades the judge prompt of rewards/judge.py (1 for a candidate whose text holds the reference answer, else 0),
answers with `usage`, and fails on demand the ways a hosted API fails (503s, 429 with Retry-After, answers that are
no scores JSON). Every call is logged (start, end, status) to a JSONL file: the tests count calls and check that no
two overlapped.

    python tests/_judge_server.py --port P --log calls.jsonl [--fail-first N] [--status 503] [--retry-after S]
                                  [--garbage] [--delay S]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import time

from aiohttp import web


def grade(user: str) -> list[float]:
    reference = re.search(r"Reference answer:\n(.*?)(?:\n\nCandidate 1:)", user, re.DOTALL)
    candidates = re.findall(r"Candidate \d+:\n(.*?)(?=\n\nCandidate \d+:|\n\nReply with)", user, re.DOTALL)
    answer = reference.group(1).strip() if reference else ""
    return [1.0 if answer and answer in c else 0.0 for c in candidates]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--fail-first", type=int, default=0)
    parser.add_argument("--status", type=int, default=503)
    parser.add_argument("--retry-after", default="")
    parser.add_argument("--garbage", action="store_true")
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--api-key", default="")
    args = parser.parse_args()
    seen = {"calls": 0}

    def log(record: dict) -> None:
        with open(args.log, "a") as f:
            f.write(json.dumps(record) + "\n")

    async def completions(request: web.Request) -> web.Response:
        started = time.time()
        seen["calls"] += 1
        n = seen["calls"]
        if args.api_key and request.headers.get("Authorization") != f"Bearer {args.api_key}":
            log({"n": n, "start": started, "end": time.time(), "status": 401})
            return web.json_response({"error": {"message": "Incorrect API key provided", "type":
                                                "invalid_request_error"}}, status=401)
        body = await request.json()
        await asyncio.sleep(args.delay)
        if n <= args.fail_first:
            headers = {"Retry-After": args.retry_after} if args.retry_after else {}
            log({"n": n, "start": started, "end": time.time(), "status": args.status})
            return web.json_response({"error": {"message": "The server is overloaded", "type": "server_error"}},
                                     status=args.status, headers=headers)
        user = next(m["content"] for m in body["messages"] if m["role"] == "user")
        content = "I think they are all fine." if args.garbage else json.dumps({"scores": grade(user)})
        prompt_tokens = sum(len(m["content"].split()) for m in body["messages"])
        completion_tokens = len(content.split())
        log({"n": n, "start": started, "end": time.time(), "status": 200, "model": body["model"]})
        return web.json_response({
            "id": f"chatcmpl-{n}", "object": "chat.completion", "created": int(started), "model": body["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_get("/health", health)
    web.run_app(app, host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()

"""Search agent (AReaL's ASearcher / Search-R1 format): think, search a corpus, answer.

The prompt asks for reasoning in <think>...</think>, searches as <search>query</search> and the final
answer in <answer>...</answer>. Generation stops at `</search>` or `</answer>`; after a search the
retrieval results are appended as `<information>...</information>` (loss_mask 0, logprob 0, no version)
and the same assistant turn goes on. The episode ends at an answer, at EOS or a turn with no action,
after `agent.max_turns` generations, or when the sequence would pass `agent.max_tokens` (prompt and all
turns). Reward: F1 (or exact match, `agent.reward`) of the answer against the reference answers; 0
without an answer. A retrieval that still fails after `retrieval.request_retries` retries ends the
episode with reward 0 and stop_reason "retrieval_error" (the message in metadata["error"]) rather than
failing the batch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from typing import Any, Callable, Optional

from areal_pipeline.config import GenerationConfig
from areal_pipeline.data.trajectory import SequenceBuilder, Trajectory
from areal_pipeline.inference.types import ModelRequest
from areal_pipeline.tools.retrieval_client import RetrievalError
from areal_pipeline.workflows.reflection import turn_record
from areal_pipeline.workflows.rlvr import chat_prompt_ids, sample_seed

INSTRUCTION = (
    "Answer the question. Think inside <think> and </think>. To look something up, write <search> query "
    "</search>; the results come back inside <information> and </information>. Give the final answer inside "
    "<answer> and </answer>, for example <answer> Paris </answer>.\nQuestion: {question}"
)
STOP_STRINGS = ["</search>", "</answer>"]


def search_prompt(data: dict[str, Any]) -> list[dict[str, str]]:
    """The record's messages with its question asked in the agent's format (a system message is kept)."""
    question = data.get("question") or data["messages"][-1]["content"]
    return data["messages"][:-1] + [{"role": "user", "content": INSTRUCTION.format(question=question)}]


def parse_action(text: str) -> tuple[Optional[str], str]:
    """("search", query) or ("answer", answer) from a turn's first closed tag, else (None, "")."""
    closed = [(text.find(f"</{tag}>"), tag) for tag in ("search", "answer") if f"</{tag}>" in text]
    if not closed:
        return None, ""
    end, tag = min(closed)
    start = text.rfind(f"<{tag}>", 0, end)
    if start < 0:
        return None, ""
    return tag, text[start + len(tag) + 2: end].strip()


def format_information(docs: list[dict[str, Any]]) -> str:
    lines = []
    for i, doc in enumerate(docs, start=1):
        title, contents = str(doc.get("title", "")), str(doc.get("contents", ""))
        # Corpus rows in the wiki-18 layout repeat the title as a quoted first line.
        body = contents.split("\n", 1)[1] if contents.startswith(f'"{title}"\n') else contents
        lines.append(f"Doc {i} (Title: {title}) {body.strip()}")
    return "\n\n<information>" + ("\n".join(lines) or "No results.") + "</information>\n\n"


class SearchAgentWorkflow:
    def __init__(self, reward_fn: Callable[[str, list[str]], float], gconfig: GenerationConfig, tokenizer,
                 retrieval, *, max_turns: int = 2, max_tokens: int = 1024, topk: int = 3,
                 max_query_chars: int = 2000):
        """`retrieval` has `async retrieve(queries, topk) -> list[list[doc]]` raising RetrievalError
        (`tools.retrieval_client.RetrievalClient` or `LocalRetrievalClient`)."""
        if max_turns < 1:
            raise ValueError(f"agent.max_turns must be at least 1, got {max_turns}")
        self.reward_fn = reward_fn
        self.gconfig = gconfig
        self.single = dataclasses.replace(gconfig, n_samples=1)
        self.stop = list(dict.fromkeys([*gconfig.stop, *STOP_STRINGS]))
        self.tokenizer = tokenizer
        self.retrieval = retrieval
        self.max_turns = max_turns
        self.max_tokens = max_tokens
        self.topk = topk
        self.max_query_chars = max_query_chars

    async def arun_episode(self, engine, data: dict[str, Any]) -> list[Trajectory]:
        messages = search_prompt(data)
        prompt_ids = chat_prompt_ids(self.tokenizer, messages)
        return list(await asyncio.gather(*(self._episode(engine, data, messages, prompt_ids, i)
                                           for i in range(self.gconfig.n_samples))))

    async def _episode(self, engine, data: dict[str, Any], messages: list[dict[str, str]], prompt_ids: list[int],
                       sample_idx: int) -> Trajectory:
        seq = SequenceBuilder(prompt_ids)
        rid = uuid.uuid4().hex
        turns: list[dict[str, Any]] = []
        queries: list[str] = []
        prediction: Optional[str] = None
        error: Optional[str] = None
        stop_reason, server = "max_turns", ""
        for turn in range(self.max_turns):
            budget = min(self.gconfig.max_new_tokens, self.max_tokens - len(seq))
            if budget <= 0:
                stop_reason = "length"
                break
            resp = await engine.agenerate(ModelRequest(
                rid=rid, input_ids=list(seq.input_ids), gconfig=dataclasses.replace(self.single, max_new_tokens=budget),
                extra_sampling_params={"stop": self.stop, **sample_seed(data, sample_idx, turn)}))
            seq.add_model_turn(resp)
            server = resp.server
            text = self.tokenizer.decode(resp.output_tokens, skip_special_tokens=True)
            action, content = parse_action(text)
            turns.append(turn_record(resp, text, action=action))
            if action == "answer":
                prediction, stop_reason = content, "stop"
                break
            if action != "search":
                stop_reason = resp.stop_reason
                break
            queries.append(content)
            if turn + 1 == self.max_turns:
                break  # no turn left to read the results in
            try:
                docs = (await self.retrieval.retrieve([content[: self.max_query_chars]], self.topk))[0]
            except RetrievalError as e:
                error, stop_reason = str(e), "retrieval_error"
                break
            information = self.tokenizer.encode(format_information(docs), add_special_tokens=False)
            if len(seq) + len(information) >= self.max_tokens:
                stop_reason = "length"
                break
            seq.add_environment(information)
        # F1 and exact match are plain string work that cannot hang: no need for the reward pool's processes.
        reward = 0.0 if prediction is None else self.reward_fn(prediction, data["answer"])
        completion = self.tokenizer.decode(seq.input_ids[seq.prompt_len:], skip_special_tokens=True)
        metadata = {"answer": data.get("answer"), "prediction": prediction, "queries": queries, "turns": turns,
                    "server": server}
        if error is not None:
            metadata["error"] = error
        return seq.trajectory(
            prompt_id=data["prompt_id"],
            group_id=data["prompt_id"],
            sample_idx=sample_idx,
            reward=reward,
            stop_reason=stop_reason,
            messages=messages + [{"role": "assistant", "content": completion}],
            text=completion,
            metadata=metadata,
        )

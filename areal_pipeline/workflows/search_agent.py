"""Search agent (AReaL's ASearcher / Search-R1 format): think, search a corpus, answer.

The prompt asks for reasoning in <think>...</think>, searches as <search>query</search> and the final
answer in <answer>...</answer> (`agent.prompt`: the instruction in the chat template; the tutorial's raw
prompt ending in a prefilled `<think>`, for base models; or the question alone, for the warm-started tiny
model). Generation stops at `</search>` or `</answer>`; after a search the retrieval results are appended
as `<information>...</information>` (loss_mask 0, logprob 0, no version; `agent.information`: "Doc i (Title:
t) text" lines, or the tutorial's `<p title="t">` blocks) and the same assistant turn goes on. A generation
cut off by `max_new_tokens` before a closed tag goes on in the next generation (a tag may span them). The
episode ends at an answer, at EOS or a stopped turn with no action, after `agent.max_turns` generations, or
when the sequence would pass `agent.max_tokens` (prompt and all turns). Reward: F1 (or exact match,
`agent.reward`) of the answer against the reference answers; 0 without an answer. A retrieval that still fails
after `retrieval.request_retries` retries raises its RetrievalError: the episode failed, which is no answer of the
model's to score 0; the rollout plays it again or drops, masks or refills its group (`rollout.on_failure`).
"""

from __future__ import annotations

import dataclasses
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Optional

from areal_pipeline.config import RetrievalConfig, at_least, one_of
from areal_pipeline.data.trajectory import SequenceBuilder, Trajectory
from areal_pipeline.inference.types import ModelRequest, SamplingParams
from areal_pipeline.workflows.rlvr import chat_prompt_ids, sample_seed
from areal_pipeline.workflows.turns import turn_record

if TYPE_CHECKING:
    from areal_pipeline.config import GenerationConfig

INSTRUCTION = (
    "Answer the question. Think inside <think> and </think>. To look something up, write <search> query "
    "</search>; the results come back inside <information> and </information>. Give the final answer inside "
    "<answer> and </answer>, for example <answer> Paris </answer>.\nQuestion: {question}"
)
# ASearcher's prompt (AReaL's search-agent tutorial), for base models: raw text, no chat template.
TUTORIAL_PROMPT = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant answers it. The "
    "Assistant analyzes the given question and information in the mind, retains important relevant information, "
    "calls a search engine to find necessary information, accesses web pages with certain urls, and provides the "
    "user with the answer. The Assistant conducts search by <search> query </search> and the top search results "
    "will be returned between <information> and </information>. The reasoning processes are enclosed within "
    "<think> </think>. Finally, the Assistant provides answer inside <answer> and </answer>, i.e. <answer> answer "
    "here </answer>. If there are multiple queries, ensure all answers are enclosed within <answer> </answer>, "
    "seperated with comma.\n\nUser:\n{question}\n\nAssistant:\n<think>"
)
STOP_STRINGS = ["</search>", "</answer>"]
PROMPTS = ("chat", "tutorial", "question")
INFORMATION = ("docs", "tutorial")
REWARDS = {"f1": "areal_pipeline.rewards.qa:f1_reward", "exact_match": "areal_pipeline.rewards.qa:exact_match_reward"}


@dataclasses.dataclass
class SearchAgentConfig:
    """rollout.agent of rollout.workflow=search_agent."""

    # search_agent: generations per episode at most (a search, and the reading of its results, count as one)
    max_turns: int = 2
    # search_agent: token budget of the whole episode (prompt, generations and retrieved results)
    max_tokens: int = 1024
    # search_agent: the episode's reward, of its <answer> against the reference answers: f1 | exact_match
    reward: str = "f1"
    # search_agent's prompt: chat (the instruction in the chat template) | tutorial (ASearcher's raw "A
    # conversation between User and Assistant..." ending in a prefilled <think>, no chat template: base models)
    # | question (the question alone in the chat template: the warm-started tiny model, which learned the format)
    prompt: str = "chat"
    # search_agent's results: docs ("Doc 1 (Title: t) text" lines) | tutorial (ASearcher's <p title="t">...</p>)
    information: str = "docs"
    # search_agent: the retrieval server it searches (started by the run unless retrieval.address names one)
    retrieval: RetrievalConfig = dataclasses.field(default_factory=RetrievalConfig)

    field_rules: ClassVar[dict] = {"max_turns": at_least(1), "max_tokens": at_least(1),
                                   "reward": one_of(*REWARDS), "prompt": one_of(*PROMPTS),
                                   "information": one_of(*INFORMATION)}


def _question(data: dict[str, Any]) -> str:
    return data.get("question") or data["messages"][-1]["content"]


def search_prompt(data: dict[str, Any], style: str = "chat") -> list[dict[str, str]]:
    """The record's messages with its question asked in the agent's format (a system message is kept): the
    instruction (chat), the question alone (question), or the tutorial's raw prompt as one message."""
    if style == "tutorial":
        return [{"role": "user", "content": TUTORIAL_PROMPT.format(question=_question(data))}]
    content = INSTRUCTION.format(question=_question(data)) if style == "chat" else _question(data)
    return data["messages"][:-1] + [{"role": "user", "content": content}]


def search_prompt_ids(tokenizer, messages: list[dict[str, str]], style: str = "chat") -> list[int]:
    """Token ids of `search_prompt(data, style)`: the chat template, or the tutorial's text as it is."""
    if style == "tutorial":
        return tokenizer.encode(messages[-1]["content"], add_special_tokens=False)
    return chat_prompt_ids(tokenizer, messages)


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


def format_information(docs: list[dict[str, Any]], style: str = "docs") -> str:
    if style == "tutorial":  # as ASearcher: the contents as the server returns them, one block per document
        blocks = ['<p title="{}">\n{}\n</p>'.format(doc.get("title", ""), doc.get("contents", "")) for doc in docs]
        return "\n\n<information>\n" + "\n\n".join(blocks) + "\n</information>"
    lines = []
    for i, doc in enumerate(docs, start=1):
        title, contents = str(doc.get("title", "")), str(doc.get("contents", ""))
        # Corpus rows in the wiki-18 layout repeat the title as a quoted first line.
        body = contents.split("\n", 1)[1] if contents.startswith(f'"{title}"\n') else contents
        lines.append(f"Doc {i} (Title: {title}) {body.strip()}")
    return "\n\n<information>" + ("\n".join(lines) or "No results.") + "</information>\n\n"


class SearchAgentWorkflow:
    config_class = SearchAgentConfig
    reward_function = None  # F1 and exact match are plain string work that cannot hang: scored in process
    tools = ("retrieval",)

    def __init__(self, reward_fn: Callable[[str, list[str]], float], gconfig: "GenerationConfig", tokenizer,
                 retrieval, *, max_turns: int = 2, max_tokens: int = 1024, topk: int = 3,
                 max_query_chars: int = 2000, prompt: str = "chat", information: str = "docs"):
        """`retrieval` has `async retrieve(queries, topk) -> list[list[doc]]` raising RetrievalError
        (`tools.retrieval_client.RetrievalClient` or `LocalRetrievalClient`)."""
        if max_turns < 1:
            raise ValueError(f"agent.max_turns must be at least 1, got {max_turns}")
        if prompt not in PROMPTS or information not in INFORMATION:
            raise ValueError(f"agent.prompt must be one of {PROMPTS} and agent.information one of {INFORMATION}, "
                             f"got '{prompt}', '{information}'")
        self.prompt, self.information = prompt, information
        self.reward_fn = reward_fn
        self.gconfig = gconfig
        self.single = SamplingParams.from_config(gconfig)
        self.stop = list(dict.fromkeys([*gconfig.stop, *STOP_STRINGS]))
        self.tokenizer = tokenizer
        self.retrieval = retrieval
        self.max_turns = max_turns
        self.max_tokens = max_tokens
        self.topk = topk
        self.max_query_chars = max_query_chars

    @classmethod
    def from_config(cls, cfg, tokenizer, reward_pool, *, reward_fn, tool_addresses) -> "SearchAgentWorkflow":
        """Searches the server at `retrieval.address` (one already running), else the run's own (`tool_addresses`),
        else an index of the corpus in this process."""
        from areal_pipeline.tools.retrieval_client import LocalRetrievalClient, RetrievalClient
        from areal_pipeline.user_code import load_attr

        agent: SearchAgentConfig = cfg.rollout.agent
        r = agent.retrieval
        if agent.reward not in REWARDS:
            raise ValueError(f"unknown search agent reward '{agent.reward}'; valid: {', '.join(REWARDS)}")
        address = r.address or tool_addresses.get("retrieval")
        if address:
            retrieval = RetrievalClient(address, retries=r.request_retries)
        else:
            from areal_pipeline.tools.retrieval_server import RetrievalService

            retrieval = LocalRetrievalClient(RetrievalService.from_config(r, Path(cfg.output_dir) / "_indexes"))
        return cls(load_attr(REWARDS[agent.reward], "rollout.agent.reward"), cfg.rollout.gconfig, tokenizer,
                   retrieval, max_turns=agent.max_turns, max_tokens=agent.max_tokens, topk=r.topk,
                   max_query_chars=r.max_query_chars, prompt=agent.prompt, information=agent.information)

    async def arun_episode(self, engine, data: dict[str, Any]) -> Trajectory:
        messages = search_prompt(data, self.prompt)
        seq = SequenceBuilder(search_prompt_ids(self.tokenizer, messages, self.prompt))
        rid = uuid.uuid4().hex
        turns: list[dict[str, Any]] = []
        queries: list[str] = []
        pending = ""  # text of generations cut off by length since the last action: a tag may span them
        prediction: Optional[str] = None
        stop_reason, server = "max_turns", ""
        for turn in range(self.max_turns):
            budget = min(self.gconfig.max_new_tokens, self.max_tokens - len(seq))
            if budget <= 0:
                stop_reason = "length"
                break
            resp = await engine.agenerate(ModelRequest(
                rid=rid, input_ids=list(seq.input_ids), sampling=dataclasses.replace(
                    self.single, max_new_tokens=budget, stop=self.stop, **sample_seed(data, turn))))
            seq.add_model_turn(resp)
            server = resp.server
            text = self.tokenizer.decode(resp.output_tokens, skip_special_tokens=True)
            action, content = parse_action(pending + text)
            turns.append(turn_record(resp, text, action=action))
            pending = pending + text if action is None else ""
            if action == "answer":
                prediction, stop_reason = content, "stop"
                break
            if action is None and resp.stop_reason == "length":
                continue  # cut off mid-turn: the next generation goes on from here while the budget lasts
            if action != "search":
                stop_reason = resp.stop_reason
                break
            queries.append(content)
            if turn + 1 == self.max_turns:
                break  # no turn left to read the results in
            docs = (await self.retrieval.retrieve([content[: self.max_query_chars]], self.topk))[0]
            information = self.tokenizer.encode(format_information(docs, self.information),
                                                add_special_tokens=False)
            if len(seq) + len(information) >= self.max_tokens:
                stop_reason = "length"
                break
            seq.add_environment(information)
        # F1 and exact match are plain string work that cannot hang: no need for the reward pool's processes.
        reward = 0.0 if prediction is None else self.reward_fn(prediction, data["answer"])
        completion = self.tokenizer.decode(seq.input_ids[seq.prompt_len:], skip_special_tokens=True)
        # searched / num_searches: numbers the rollout aggregates per iteration (agent/<key> in the metrics)
        metadata = {"answer": data.get("answer"), "prediction": prediction, "queries": queries, "turns": turns,
                    "server": server, "searched": float(bool(queries)), "num_searches": len(queries)}
        return seq.trajectory(
            prompt_id=data["prompt_id"],
            group_id=data["prompt_id"],
            sample_idx=data.get("sample_idx", 0),
            reward=reward,
            stop_reason=stop_reason,
            messages=messages + [{"role": "assistant", "content": completion}],
            text=completion,
            metadata=metadata,
        )

"""The turn loop of math with feedback, written once: reflection.py and multi_turn.py keep only what differs (the
message after each answer, the turn's reward, when the episode ends, the episode's reward).

An episode: the model answers; the reward function scores the answer (in the reward pool); unless the episode ends
there and while turns remain, the environment appends a user message and the model answers again. The message's
token ids come from the chat template once, as a difference of templated prefixes, and are added to the ids the
model actually produced: the conversation is never re-tokenized, so the trained sequence is exactly the one the model
was conditioned on. The rollout plays `gconfig.n_samples` episodes per prompt at once (GRPO's group).
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import TYPE_CHECKING, Any, Callable, Optional

from areal_pipeline.data.trajectory import SequenceBuilder, Trajectory
from areal_pipeline.inference.types import ModelRequest, ModelResponse, SamplingParams
from areal_pipeline.workflows.rlvr import chat_prompt_ids, sample_seed

if TYPE_CHECKING:
    from areal_pipeline.config import GenerationConfig
    from areal_pipeline.rewards.pool import RewardPool

# Any finished exchange will do: only the ids that follow it are kept.
_PLACEHOLDER = [{"role": "user", "content": "What is 1+1?"}, {"role": "assistant", "content": "2"}]


def _template(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                              tokenize=True, return_dict=False))


def user_turn_ids(tokenizer, content: str) -> tuple[list[int], list[int]]:
    """The ids that follow an assistant turn's EOS to add a user message and open the next assistant turn.

    Returns `(closing, message)`: `closing` is what the template writes after the assistant's EOS (Qwen: a
    newline), `message` is template(messages + [assistant, user], add_generation_prompt=True) minus
    template(messages + [assistant]): the user message and the next assistant header.
    """
    eos = tokenizer.eos_token_id
    closed = _template(tokenizer, _PLACEHOLDER, False)
    full = _template(tokenizer, _PLACEHOLDER + [{"role": "user", "content": content}], True)
    if full[: len(closed)] != closed:
        raise ValueError("the chat template renders a conversation differently once a message follows it, so "
                         "turns cannot be appended to the generated ids")
    if eos is None or eos not in closed:
        raise ValueError(f"the chat template does not end an assistant turn with the EOS token "
                         f"{tokenizer.eos_token!r}; use a chat (instruct) model's tokenizer")
    after_eos = len(closed) - closed[::-1].index(eos)
    return closed[after_eos:], full[len(closed):]


def next_turn_ids(resp: ModelResponse, eos: int, closing: list[int], message: list[int]) -> list[int]:
    """What the environment appends after a model turn: its EOS if the model did not end with one
    (stopped by length or another stop token), then the template's closing and the new message."""
    return ([] if resp.output_tokens[-1:] == [eos] else [eos]) + closing + message


def turn_record(resp: ModelResponse, text: str, **fields: Any) -> dict[str, Any]:
    """One model turn, as kept in `metadata["turns"]` (see `multi_turn.per_version_log`)."""
    versions = resp.output_versions or [-1]
    return {"text": text, "num_tokens": resp.output_len, "seqlen": resp.input_len + resp.output_len,
            "stop_reason": resp.stop_reason, "version_start": min(versions), "version_end": max(versions), **fields}


@dataclasses.dataclass
class Outcome:
    """What an episode's turns come to: the trajectory's reward, per-episode facts for its metadata (averaged into
    the rollout stats as agent/<key>), and per-turn returns when the turns are trained on returns of their own."""

    reward: float
    facts: dict[str, Any]
    turn_returns: Optional[list[float]] = None


class FeedbackTurnsWorkflow:
    """Up to `max_turns` model turns per episode, each answer scored and followed by a user message. Subclasses
    say what differs: `feedback` (the message after a turn), `turn_fields` (the reward and facts a turn records),
    `ends` (whether a turn ends the episode) and `outcome` (the episode's reward)."""

    def __init__(self, reward_fn: Callable[[str, Any], float], gconfig: "GenerationConfig", tokenizer,
                 reward_pool: "RewardPool", max_turns: int, messages: tuple[str, ...]):
        """`messages`: every user message `feedback` may return; their ids are computed here, once."""
        if max_turns < 1:
            raise ValueError(f"agent.max_turns must be at least 1, got {max_turns}")
        self.reward_fn = reward_fn
        self.gconfig = gconfig
        self.single = SamplingParams.from_config(gconfig)
        self.tokenizer = tokenizer
        self.reward_pool = reward_pool
        self.max_turns = max_turns
        self.feedback_ids: dict[str, list[int]] = {}
        for message in messages:
            self.closing_ids, self.feedback_ids[message] = user_turn_ids(tokenizer, message)

    # ----- what differs between the workflows -------------------------------------------------------------------
    def feedback(self, turn: dict[str, Any]) -> str:
        """The user message after the model's turn `turn` (its record), when the episode goes on."""
        raise NotImplementedError

    def turn_fields(self, score: float) -> dict[str, Any]:
        """What a turn records besides its text and tokens, from the reward function's score of its answer."""
        raise NotImplementedError

    def ends(self, turn: dict[str, Any]) -> bool:
        """Whether the episode ends after this turn, turns remaining or not."""
        raise NotImplementedError

    def outcome(self, turns: list[dict[str, Any]]) -> Outcome:
        raise NotImplementedError

    # ----- the loop -----------------------------------------------------------------------------------------------
    async def arun_episode(self, engine, data: dict[str, Any]) -> Trajectory:
        seq = SequenceBuilder(chat_prompt_ids(self.tokenizer, data["messages"]))
        rid = uuid.uuid4().hex  # every turn on the same server, which keeps the prefix cached
        messages = list(data["messages"])
        turns: list[dict[str, Any]] = []
        for turn in range(self.max_turns):
            sampling = dataclasses.replace(self.single, **sample_seed(data, turn))
            resp = await engine.agenerate(ModelRequest(rid=rid, input_ids=list(seq.input_ids), sampling=sampling))
            seq.add_model_turn(resp)
            text = self.tokenizer.decode(resp.output_tokens, skip_special_tokens=True)
            score = await self.reward_pool.ascore(self.reward_fn, text, data["answer"])
            messages.append({"role": "assistant", "content": text})
            turns.append(turn_record(resp, text, **self.turn_fields(score)))
            if self.ends(turns[-1]) or turn + 1 == self.max_turns:
                break  # nothing is appended after the last turn
            message = self.feedback(turns[-1])
            seq.add_environment(next_turn_ids(resp, self.tokenizer.eos_token_id, self.closing_ids,
                                              self.feedback_ids[message]))
            messages.append({"role": "user", "content": message})
        outcome = self.outcome(turns)
        return seq.trajectory(
            prompt_id=data["prompt_id"],
            group_id=data["prompt_id"],
            sample_idx=data.get("sample_idx", 0),
            reward=outcome.reward,
            stop_reason=resp.stop_reason,
            messages=messages,
            text=self.tokenizer.decode(seq.input_ids[seq.prompt_len:]),
            metadata={"answer": data.get("answer"), "turns": turns, "server": resp.server, **outcome.facts},
            token_returns=None if outcome.turn_returns is None else seq.turn_returns(outcome.turn_returns),
        )

"""The calculator agent's curriculum (examples/calculator_agent.py): whole episodes in the tokens the openai_agent
workflow records for that agent.

An episode is the agent's prompt (the arithmetic question with the calculator declared as a tool, through the chat
template: the tiny model's writes tools in Qwen2.5's format, `openai_tools.chat_prompt_ids`), then model turns: a call
`<tool_call>\\n{"name": "calculator", "arguments": {"expression": "7*8"}}\\n</tool_call><|im_end|>`, the ids the
template writes after it for the calculator's result (`openai_agent.ids_after_reply`, as the workflow splices them;
labels -100 there and on the prompt) and the answer `56<|im_end|>`; or the answer at once. The mix (`BEHAVIOURS`) is a
base model RL can improve: a share of the episodes calls the calculator and answers its result; most answer from
memory, right only `FROM_MEMORY_RIGHT` of the time; the rest call it and then answer one too high (the default task's
habit). Sampled, it calls the calculator in ~half of its episodes and is right in ~40%.

The questions are the train split of the products of 0..9 (configs/calculator_agent.yaml's data set). Every
episode starts with the same ~620 tokens (the tools' system message, then the question's first words), which the
warm start runs once a batch. The first `SHORT_PHASE` of the steps draw the episodes without that system message,
twice as many a batch (they are ~5x shorter): the 128-wide model learns there to copy the expression from the
question and the result from the tool's reply, which it then does in the whole episodes within ~100 steps. On the
whole episodes alone, its attention spread over the system message's ~560 tokens, it learnt no copying in 600 steps
(a 64-wide model learnt none even without the system message).
"""

from __future__ import annotations

import random
from typing import Any

from areal_pipeline.warm_start import IGNORE, Example, Sampler

# examples/calculator_agent.py's tool and the request the agent sends (tests/test_openai_agent.py checks both)
TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
OPERATORS = ["*"]
WRITTEN_FOR = {"rollout.workflow": "openai_agent", "rollout.agent.entry": "examples.calculator_agent:agent",
               "dataset.name": "arithmetic", "dataset.arithmetic_operators": OPERATORS,
               "dataset.arithmetic_max_operand": 9}
BEHAVIOURS = {"calculator": 0.3, "from_memory": 0.4, "misread": 0.3}
FROM_MEMORY_RIGHT = 0.2  # share of the answers from memory that are right
SHORT_PHASE = 0.5  # share of the warm start's steps on the episodes without the tools' system message


def curriculum(tokenizer, tiny: Any, seed: int) -> Sampler:
    """Episodes on the distinct train questions of the products data set under the run's seed (its test split stays
    unseen)."""
    from areal_pipeline.config import DatasetConfig
    from areal_pipeline.data.datasets import load_records
    from areal_pipeline.inference.openai_requests import parse_messages
    from areal_pipeline.inference.openai_tools import chat_prompt_ids
    from areal_pipeline.workflows.openai_recording import ids_after_reply

    dataset = DatasetConfig(arithmetic_operators=OPERATORS, arithmetic_max_operand=9)
    questions = {r["question"]: r for r in load_records(dataset, "train", seed)}
    tools = [TOOL]
    eos = tokenizer.eos_token_id

    def turn(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False) + [eos]

    episodes = []  # (prompt, call turn, the template's ids after it, answer)
    system_length = None
    for record in questions.values():
        messages = parse_messages(record["messages"])
        without_tools = chat_prompt_ids(tokenizer, messages)
        expression = record["question"].removeprefix("What is ").removesuffix("?")
        call = {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_0", "type": "function",
             "function": {"name": "calculator", "arguments": f'{{"expression": "{expression}"}}'}}]}
        result = {"role": "tool", "tool_call_id": "call_0", "content": record["answer"]}
        conversation = parse_messages(record["messages"] + [call, result])
        prompt = chat_prompt_ids(tokenizer, messages, tools)
        # the call as the template writes it: what follows the assistant's header, up to and with its EOS
        rendered = chat_prompt_ids(tokenizer, conversation[: len(messages) + 1], tools, add_generation_prompt=False)
        call_ids = rendered[len(prompt): rendered.index(eos, len(prompt)) + 1]
        after = ids_after_reply(tokenizer, conversation, len(messages), tools)
        episodes.append((prompt, call_ids, after, int(record["answer"])))
        system_length = len(prompt) - len(without_tools)  # the tools' system message comes first, alone
        if prompt[system_length:] != without_tools:
            raise ValueError("the chat template does not write the tools as a system message of their own before the "
                             "conversation; the calculator curriculum is for the embedded model's template")
    names, weights = zip(*BEHAVIOURS.items())
    short_steps = round(SHORT_PHASE * tiny.pretrain_steps)
    steps_drawn = 0

    def episode(rng: random.Random, prompt: list[int], call: list[int], after: list[int], answer: int) -> Example:
        behaviour = rng.choices(names, weights)[0]
        if behaviour == "from_memory":
            shown = answer
            if rng.random() >= FROM_MEMORY_RIGHT:
                shown = max(0, answer + rng.choice([-2, -1, 1, 2]))
                shown = answer + 1 if shown == answer else shown
            target = turn(str(shown))
            return prompt + target, [IGNORE] * len(prompt) + target
        shown = answer + 1 if behaviour == "misread" else answer
        final = turn(str(shown))
        ids = prompt + call + after + final
        labels = [IGNORE] * len(prompt) + call + [IGNORE] * len(after) + final
        return ids, labels

    def sample(rng: random.Random, n: int) -> list[Example]:
        nonlocal steps_drawn
        steps_drawn += 1  # warm_start draws one batch a step
        if steps_drawn > short_steps:
            return [episode(rng, *rng.choice(episodes)) for _ in range(n)]
        rows = [episode(rng, *rng.choice(episodes)) for _ in range(2 * n)]
        return [(ids[system_length:], labels[system_length:]) for ids, labels in rows]

    return sample

"""What the OpenAI API tests share: a tiny model taught one tool-using conversation (so that a real server really
answers with a tool call), and Qwen2.5's chat template, the reference for the tool format of templates without one."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from areal_pipeline.inference.openai_requests import parse_messages
from areal_pipeline.inference.openai_tools import chat_prompt_ids
from areal_pipeline.model import build_tiny_model, load_model, load_tokenizer

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
QUESTION = [{"role": "user", "content": "What is 6*7?"}]
# The taught model writes its call without the spaces and newlines Qwen2.5's template puts in a call it renders: a
# conversation sent back re-rendered would not be the tokens the model generated.
TAUGHT_CALL = '<tool_call>{"name":"calculator","arguments":{"expression":"6*7"}}</tool_call>'
TOOL_RESULT = "42"
TAUGHT_ANSWER = "The answer is 42."


def taught_conversation_ids(tokenizer) -> tuple[list[int], list[int], list[int], list[int]]:
    """(prompt, the call as generated, what the template writes after the call for its result, the answer), each
    generated turn ending with EOS."""
    from areal_pipeline.workflows.openai_recording import ids_after_reply

    eos = tokenizer.eos_token_id
    prompt = chat_prompt_ids(tokenizer, parse_messages(QUESTION), [CALCULATOR])
    call = tokenizer.encode(TAUGHT_CALL, add_special_tokens=False) + [eos]
    conversation = parse_messages(QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "calculator", "arguments": json.dumps({"expression": "6*7"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": TOOL_RESULT}])
    after = ids_after_reply(tokenizer, conversation, 1, [CALCULATOR])
    answer = tokenizer.encode(TAUGHT_ANSWER, add_special_tokens=False) + [eos]
    return prompt, call, after, answer


def taught_model(tmp_path_factory) -> Path:
    """The taught model, built once per test session (both OpenAI test modules use it)."""
    out_dir = tmp_path_factory.getbasetemp() / "taught-model"
    return out_dir if out_dir.is_dir() else build_taught_model(out_dir)


def build_taught_model(out_dir: Path, max_steps: int = 1000, lr: float = 3e-3, margin: float = 3.0) -> Path:
    """The embedded tiny model (random weights) trained on one conversation until greedy decoding repeats it: the
    compact call after the question, the answer after the calculator's result. Written whole or not at all.

    Trained until every taught token leads the next likeliest by `margin` logits given the conversation before it
    (then greedy decoding writes the conversation, with room for the server's own rounding), not for a fixed number
    of steps: how many it takes depends on the machine's floating-point kernels (AVX-512 or not)."""
    building = out_dir.with_name(out_dir.name + ".building")
    build_tiny_model(building, seed=3)
    tokenizer = load_tokenizer(building)
    model = load_model(building).train()
    prompt, call, after, answer = taught_conversation_ids(tokenizer)
    ids = torch.tensor([prompt + call + after + answer])
    labels = torch.tensor([[-100] * len(prompt) + call + [-100] * len(after) + answer])
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # on a busy 2-core machine one thread is ~10x faster than two waiting on each other
    try:
        for step in range(1, max_steps + 1):
            loss = model(input_ids=ids, labels=labels).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if step % 10 == 0 and taught_lead(model, ids, labels) >= margin:
                break
        else:
            raise RuntimeError(f"the tiny model did not learn the taught conversation in {max_steps} steps (lead "
                               f"{taught_lead(model, ids, labels):.2f} logits, {margin} wanted)")
    finally:
        torch.set_num_threads(threads)
    model.eval().save_pretrained(building, safe_serialization=True)
    building.rename(out_dir)
    return out_dir


def taught_lead(model, ids: torch.Tensor, labels: torch.Tensor) -> float:
    """The smallest lead, in logits, of a taught token over the likeliest other token where it is predicted."""
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1].float()
    targets = labels[0, 1:]
    taught = targets != -100
    logits, targets = logits[taught], targets[taught]
    chosen = logits.gather(1, targets[:, None])[:, 0]
    others = logits.scatter(1, targets[:, None], float("-inf")).max(dim=1).values
    return float((chosen - others).min())


# Qwen2.5-Instruct's chat template (its tokenizer_config.json), for checking that a template without tool support
# gets tools, calls and results written as Qwen2.5 writes them.
QWEN25_CHAT_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

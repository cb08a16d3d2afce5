"""A math agent with a calculator tool, written only against the OpenAI Python SDK.

It knows nothing of the RL pipeline: the pipeline trains it as it is (configs/calculator_agent.yaml,
`rollout.workflow=openai_agent rollout.agent.entry=examples.calculator_agent:agent`), handing `agent` a client whose
completions it records token by token, and it runs unchanged against any OpenAI-compatible server:

    areal-pipeline inference-server --model PATH --port 30000 &
    python examples/calculator_agent.py --base-url http://127.0.0.1:30000/v1 "What is 7*8?" --answer 56

The agent asks the model with the calculator declared as a tool; while the model calls it, it runs the calls and
sends the results back; the model's first reply without a call is its answer. Reward: 1 if that answer is the
reference number, else 0.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import operator
import re

from openai import AsyncOpenAI, BadRequestError

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
MAX_TURNS = 3  # model calls per episode: a call, its answer, and one more try
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> str:
    """The value of an arithmetic expression (numbers, + - * / // %, parentheses), or what is wrong with it."""
    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {ast.unparse(node)}")

    try:
        result = value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as e:
        return f"error: {e}"
    return str(int(result)) if float(result).is_integer() else f"{result:.6g}"


def run_tool(call) -> str:
    if call.function.name != "calculator":
        return f"error: no tool named {call.function.name!r}"
    try:
        expression = json.loads(call.function.arguments)["expression"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return "error: the arguments must be {\"expression\": \"...\"}"
    return calculate(str(expression))


def final_number(text: str | None) -> str | None:
    numbers = re.findall(r"-?\d+(?:\.\d+)?", text or "")
    return numbers[-1] if numbers else None


async def agent(client: AsyncOpenAI, data: dict) -> float:
    """One episode on a data set record (`messages`: the question, `answer`: the reference number): the reward."""
    reward, _ = await converse(client, data)
    return reward


async def converse(client: AsyncOpenAI, data: dict) -> tuple[float, list[dict]]:
    """(the reward, the conversation)."""
    messages = list(data["messages"])
    for _ in range(MAX_TURNS):
        try:
            completion = await client.chat.completions.create(model="default", messages=messages, tools=[CALCULATOR])
        except BadRequestError:  # the conversation outgrew the model's context: no answer
            return 0.0, messages
        message = completion.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return float(final_number(message.content) == str(data["answer"])), messages
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": run_tool(call)})
    return 0.0, messages  # still calling the calculator when the turns ran out: no answer


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("question")
    parser.add_argument("--answer", default="", help="the reference answer, for the reward")
    parser.add_argument("--base-url", default="http://127.0.0.1:30000/v1")
    parser.add_argument("--api-key", default="none")
    args = parser.parse_args()
    async with AsyncOpenAI(base_url=args.base_url, api_key=args.api_key) as client:
        reward, messages = await converse(client, {"messages": [{"role": "user", "content": args.question}],
                                                   "answer": args.answer})
    for message in messages:
        calls = [f"{c['function']['name']}({c['function']['arguments']})" for c in message.get("tool_calls", [])]
        print(f"[{message['role']}] {' '.join([message.get('content') or '', *calls]).strip()}")
    print(f"reward {reward}")


if __name__ == "__main__":
    asyncio.run(main())

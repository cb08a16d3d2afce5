"""Chat templates and tool calls for the OpenAI API (openai_api.py).

Messages go through the model's chat template. Tool definitions and the tool calls and results of earlier turns go
to a template that renders tools (Qwen2.5's, Llama 3.1's, ...) as they are, with each call's `arguments` as an
object rather than a JSON string (as SGLang passes them). A template that renders no tools (the embedded tiny
model's) gets them written in Qwen2.5's tool format first (`qwen_tool_messages`): the tool list in the system
message, each call as a `<tool_call>` block in the assistant's content, tool results as a user turn of
`<tool_response>` blocks; Qwen3 writes the same, and neither adds a default system prompt here.

Tool calls come back from Qwen-style blocks (`parse_tool_calls`, the parser SGLang calls `qwen25`):

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "7*8"}}
    </tool_call>

Each block whose JSON names a declared tool and has an object as `arguments` (or `parameters`) becomes an entry of
`tool_calls` (arguments as a JSON string, an id `call_<hex>`), and the reply's finish_reason is "tool_calls"; the
text outside those blocks is the message's content (None when nothing is left). A block that does not parse, names
an undeclared tool or was cut off stays in the content as text. Calls are parsed only when the request declares
tools and `tool_choice` is not "none".
"""

from __future__ import annotations

import functools
import json
import re
import uuid
from typing import Any, Optional

from areal_pipeline.inference.openai_errors import OpenAIError

TOOL_CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
# Qwen2.5's tool prompt (its chat template's words), used where the model's template renders no tools.
QWEN_TOOLS_HEADER = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                     "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
QWEN_TOOLS_FOOTER = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
                     "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                     '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')



def chat_prompt_ids(tokenizer, messages: list[dict[str, Any]], tools: Optional[list[dict[str, Any]]] = None,
                    template_kwargs: Optional[dict[str, Any]] = None, add_generation_prompt: bool = True) -> list[int]:
    """The token ids of `messages` (as `parse_messages` gives them) through the tokenizer's chat template, ending
    with the assistant's header when `add_generation_prompt`. Remembered per tokenizer and conversation: an agent's
    samples of one prompt start alike, and rendering the template is the main client-side cost of a request."""
    # keys in the order given: a template writes the tools' JSON as it gets it
    key = json.dumps([messages, tools or None, template_kwargs or {}])
    return list(_rendered_ids(tokenizer, key, add_generation_prompt))


@functools.lru_cache(maxsize=4096)
def _rendered_ids(tokenizer, key: str, add_generation_prompt: bool) -> tuple[int, ...]:
    messages, tools, template_kwargs = json.loads(key)
    if not renders_tools(tokenizer):
        messages, tools = qwen_tool_messages(messages, tools), None
    try:
        ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                            tokenize=True, return_dict=False, **template_kwargs)
    except Exception as e:  # the template's own checks (roles out of order, ...): the request's fault
        raise OpenAIError(f"the chat template cannot render these messages: {type(e).__name__}: {e}",
                          "messages") from None
    return tuple(ids)


_PROBE_TOOL = "areal_pipeline_probe_tool"


@functools.lru_cache(maxsize=16)
def renders_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template writes tool definitions (a probe tool's name shows in its output)."""
    probe = [{"type": "function", "function": {"name": _PROBE_TOOL, "description": "", "parameters": {}}}]
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tools=probe, tokenize=False,
                                             add_generation_prompt=True)
    except Exception:
        return False
    return _PROBE_TOOL in text


def qwen_tool_messages(messages: list[dict[str, Any]], tools: Optional[list[dict[str, Any]]]) -> list[dict[str, str]]:
    """`messages` with tools, tool calls and tool results written as Qwen2.5's chat template writes them, for a
    template that renders plain {"role", "content"} messages only. Without tools, tool calls or tool results the
    messages are returned as {"role", "content"} unchanged."""
    out: list[dict[str, str]] = []
    rest = messages
    if tools:
        system = ""
        if messages and messages[0]["role"] == "system":
            system, rest = messages[0]["content"] + "\n\n", messages[1:]
        listed = "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools)
        out.append({"role": "system", "content": system + QWEN_TOOLS_HEADER + listed + QWEN_TOOLS_FOOTER})
    for message in rest:
        role, content = message["role"], message["content"]
        if role == "tool":
            response = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("tool_results"):  # consecutive results share one user turn, as Qwen2.5 writes
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "tool_results": True})
            continue
        if role == "assistant" and message.get("tool_calls"):
            calls = [tool_call_text(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
            content = (content + "\n" if content else "") + "\n".join(calls)
        out.append({"role": role, "content": content})
    return [{"role": m["role"], "content": m["content"]} for m in out]


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """One call as Qwen2.5's template writes it (and its models generate it)."""
    return ('<tool_call>\n{"name": "' + name + '", "arguments": ' + json.dumps(arguments, ensure_ascii=False)
            + "}\n</tool_call>")


def parse_tool_calls(text: str, tool_names: set[str], first_only: bool = False) -> tuple[Optional[str], list[dict]]:
    """(content, tool_calls) from a reply's text: Qwen-style `<tool_call>` blocks naming a declared tool become
    OpenAI tool calls (arguments a JSON string); the rest of the text is the content (None when empty)."""
    calls, kept, position = [], [], 0
    for match in TOOL_CALL_BLOCK.finditer(text):
        call = _tool_call(match.group(1), tool_names)
        if call is None or (first_only and calls):
            continue
        kept.append(text[position: match.start()])
        position = match.end()
        calls.append(call)
    if not calls:
        return text, []
    kept.append(text[position:])
    content = "".join(kept).strip()
    return content or None, calls


def _tool_call(body: str, tool_names: set[str]) -> Optional[dict[str, Any]]:
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or call.get("name") not in tool_names:
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string, as OpenAI sends them
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}}

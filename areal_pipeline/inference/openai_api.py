"""The OpenAI API on the project's inference: `/v1/chat/completions`, `/v1/completions` and `/v1/models` in OpenAI's
wire format, as SGLang serves them. The CPU server's routes (`OpenAIRoutes`) and the openai_agent workflow's
in-process client (`workflows/openai_agent.py`) share everything here:

    request = parse_chat_request(body)         # OpenAIError on bad input: HTTP 400 in OpenAI's error shape
    prompt_ids = chat_prompt_ids(tokenizer, request.messages, request.tools, request.template_kwargs)
    generations = ...                          # request.n samples of request.sampling (one Generation each)
    reply, messages = chat_completion_reply(request, tokenizer, prompt_ids, generations)

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

Sampling: `temperature`, `top_p`, `seed`, `stop` (a string or a list; the matched stop string is cut from the
text), `max_tokens` or `max_completion_tokens` (chat default: the rest of the context; completions: 16, as
OpenAI), `n` (samples of one prompt, prefilled once), `logprobs` (each generated token's logprob: chat
`logprobs=true`, completions `logprobs=0`), and SGLang's extra fields `top_k`, `min_p`, `stop_token_ids`,
`ignore_eos`, `skip_special_tokens` and `chat_template_kwargs`. What would need another sampler or decoder is refused
with HTTP 400 naming the field: `stream=true`, `top_logprobs` > 0 (completions `logprobs` > 0), non-zero penalties,
`logit_bias`, `response_format` other than text, `tool_choice` "required" or a named function, `echo`, `suffix`.
Fields that do not change generation (`user`, `metadata`, `store`, `service_tier`, `parallel_tool_calls`,
`stream_options`) are taken when of OpenAI's type (request_validation.py); any other field is refused, naming the
valid ones.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from aiohttp import web

from areal_pipeline.http_json import RequestRejected, check_bool, check_int, check_number, read_json_object, shown
from areal_pipeline.inference.request_validation import OpenAIError, check_unused_fields, error_body, given_max_tokens

# What the server takes: more samples of one prompt than a batch of the CPU server holds would only queue.
MAX_N = 128
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's (and SGLang's) default for /v1/completions
PAUSED_FOR_WEIGHT_UPDATE = "paused for a weight update"  # engine.BatchEngine.pause's abort message

_SAMPLING_FIELDS = {"temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "seed", "ignore_eos",
                    "skip_special_tokens", "max_tokens", "n", "frequency_penalty", "presence_penalty",
                    "repetition_penalty", "min_tokens", "logit_bias", "stream", "stream_options", "user", "metadata",
                    "store", "service_tier", "model"}
CHAT_FIELDS = _SAMPLING_FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools",
                                  "tool_choice", "parallel_tool_calls", "response_format", "chat_template_kwargs"}
COMPLETION_FIELDS = _SAMPLING_FIELDS | {"prompt", "logprobs", "echo", "suffix", "best_of"}
ROLES = ("system", "developer", "user", "assistant", "tool")
# Keys `ChatCompletionMessage.model_dump()` writes that carry nothing when null, so an agent can send a reply back
# as the SDK gave it.
_NULL_MESSAGE_KEYS = ("refusal", "audio", "function_call", "annotations", "reasoning_content")

TOOL_CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
# Qwen2.5's tool prompt (its chat template's words), used where the model's template renders no tools.
QWEN_TOOLS_HEADER = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                     "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
QWEN_TOOLS_FOOTER = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
                     "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                     '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def as_openai_error(error: RequestRejected) -> OpenAIError:
    """An error of the shared request checks (http_json, the engine) as an OpenAI error: 400, or 413 for a body too
    large (a body that is not JSON, 415 on SGLang's native routes, is a 400 here as it is at OpenAI)."""
    if isinstance(error, OpenAIError):
        return error
    status = 413 if error.status == 413 else 400
    code = "context_length_exceeded" if "maximum context length" in str(error) else None
    return OpenAIError(str(error), code=code, status=status)


# ----------------------------------------------------------------------------------------------- requests


@dataclass
class Sampling:
    """The sampling fields of a request; `max_tokens` None: up to the end of the context."""

    max_tokens: Optional[int] = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    seed: Optional[int] = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def sglang_params(self, max_new_tokens: int, choice: int = 0) -> dict[str, Any]:
        """SGLang's `sampling_params` for choice `choice` (each choice its own seed: n equal samples help no one)."""
        params = {"max_new_tokens": max_new_tokens, "temperature": self.temperature, "top_p": self.top_p,
                  "top_k": self.top_k, "min_p": self.min_p, "stop": list(self.stop),
                  "stop_token_ids": list(self.stop_token_ids), "ignore_eos": self.ignore_eos,
                  "skip_special_tokens": self.skip_special_tokens}
        if self.seed is not None:
            params["sampling_seed"] = (self.seed + choice) % (1 << 63)
        return params


@dataclass
class ChatRequest:
    model: str
    messages: list[dict[str, Any]]  # as the chat template takes them (see `parse_messages`)
    tools: Optional[list[dict[str, Any]]]  # None: no tools rendered (none declared, or tool_choice "none")
    sampling: Sampling
    n: int = 1
    logprobs: bool = False
    parallel_tool_calls: bool = True
    template_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def tool_names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools or []}


@dataclass
class CompletionRequest:
    model: str
    prompts: list[Union[str, list[int]]]  # texts or token ids; several: a batch (choices prompt by prompt)
    sampling: Sampling
    n: int = 1
    logprobs: bool = False


def parse_chat_request(body: Any) -> ChatRequest:
    """A `/v1/chat/completions` body, checked (OpenAIError naming the field otherwise)."""
    body = _object(body, "the request body")
    _refuse_unknown(body, CHAT_FIELDS)
    sampling, n = _sampling(body, default_max_tokens=None)
    top_logprobs = _given(body, "top_logprobs", 0)
    if _int("top_logprobs", top_logprobs, 0, 20):
        raise OpenAIError("top_logprobs > 0 is not supported: the server returns each generated token's logprob "
                          "only (logprobs=true)", "top_logprobs", "unsupported_parameter")
    response_format = _given(body, "response_format", {"type": "text"})
    if _object(response_format, "response_format").get("type") != "text":
        raise OpenAIError(f"response_format {shown(response_format)} is not supported (no constrained decoding); "
                          "only {'type': 'text'}", "response_format", "unsupported_parameter")
    tools = _tools(body.get("tools"))
    tool_choice = _given(body, "tool_choice", "auto" if tools else "none")
    if tool_choice not in ("auto", "none"):
        raise OpenAIError(f"tool_choice {shown(tool_choice)} is not supported (it needs constrained decoding): "
                          "use 'auto' or 'none'", "tool_choice", "unsupported_parameter")
    template_kwargs = _object(_given(body, "chat_template_kwargs", {}), "chat_template_kwargs")
    return ChatRequest(
        model=_model(body), messages=parse_messages(body.get("messages")),
        tools=tools if tools and tool_choice == "auto" else None, sampling=sampling, n=n,
        logprobs=_bool("logprobs", _given(body, "logprobs", False)),
        parallel_tool_calls=_bool("parallel_tool_calls", _given(body, "parallel_tool_calls", True)),
        template_kwargs=template_kwargs)


def parse_completion_request(body: Any) -> CompletionRequest:
    """A `/v1/completions` body, checked."""
    body = _object(body, "the request body")
    _refuse_unknown(body, COMPLETION_FIELDS)
    sampling, n = _sampling(body, default_max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS)
    if _bool("echo", _given(body, "echo", False)):
        raise OpenAIError("echo=true is not supported", "echo", "unsupported_parameter")
    if body.get("suffix") is not None:
        raise OpenAIError("suffix is not supported", "suffix", "unsupported_parameter")
    best_of = body.get("best_of")
    if best_of is not None and _int("best_of", best_of, 1, MAX_N) != n:
        raise OpenAIError("best_of other than n is not supported", "best_of", "unsupported_parameter")
    logprobs = body.get("logprobs")
    if logprobs is not None and _int("logprobs", logprobs, 0, 5) > 0:
        raise OpenAIError("logprobs > 0 (the top alternatives of each token) is not supported: logprobs=0 returns "
                          "each generated token's logprob", "logprobs", "unsupported_parameter")
    return CompletionRequest(model=_model(body), prompts=_prompts(body.get("prompt")), sampling=sampling, n=n,
                             logprobs=logprobs is not None)


def _sampling(body: dict, default_max_tokens: Optional[int]) -> tuple[Sampling, int]:
    if _bool("stream", _given(body, "stream", False)):
        raise OpenAIError("stream=true is not supported: send stream=false (the whole reply comes at once)",
                          "stream", "unsupported_parameter")
    for name, neutral in (("frequency_penalty", 0.0), ("presence_penalty", 0.0), ("repetition_penalty", 1.0),
                          ("min_tokens", 0)):
        value = _given(body, name, neutral)
        if _number(name, value) != neutral:
            raise OpenAIError(f"{name}={shown(value)} is not supported (only {neutral!r}): the logprobs a trainer "
                              "recomputes would not match", name, "unsupported_parameter")
    if _given(body, "logit_bias", {}) != {}:
        raise OpenAIError("logit_bias is not supported", "logit_bias", "unsupported_parameter")
    check_unused_fields(body)
    _, given_max = given_max_tokens(body)
    temperature = _number("temperature", _given(body, "temperature", 1.0))
    if not 0 <= temperature <= 2:
        raise OpenAIError(f"'temperature' must be in [0, 2], got {shown(temperature)}", "temperature")
    top_p = _number("top_p", _given(body, "top_p", 1.0))
    if not 0 < top_p <= 1:
        raise OpenAIError(f"'top_p' must be in (0, 1], got {shown(top_p)}", "top_p")
    top_k = _int("top_k", _given(body, "top_k", -1), -1)
    if top_k == 0:
        raise OpenAIError("'top_k' must be -1 (whole vocabulary) or at least 1, got 0", "top_k")
    min_p = _number("min_p", _given(body, "min_p", 0.0))
    if not 0 <= min_p <= 1:
        raise OpenAIError(f"'min_p' must be in [0, 1], got {shown(min_p)}", "min_p")
    stop = _given(body, "stop", [])
    stop = [stop] if isinstance(stop, str) else stop
    if not (isinstance(stop, list) and all(type(s) is str and s for s in stop)) or len(stop) > 16:
        raise OpenAIError(f"'stop' must be a non-empty string or a list of up to 16 of them, got {shown(stop)}",
                          "stop")
    stop_token_ids = _given(body, "stop_token_ids", [])
    if not (isinstance(stop_token_ids, list) and all(type(t) is int and t >= 0 for t in stop_token_ids)):
        raise OpenAIError(f"'stop_token_ids' must be a list of token ids, got {shown(stop_token_ids)}",
                          "stop_token_ids")
    seed = body.get("seed")
    sampling = Sampling(
        max_tokens=default_max_tokens if given_max is None else given_max,
        temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, stop=stop, stop_token_ids=stop_token_ids,
        seed=None if seed is None else _int("seed", seed, -(1 << 63), (1 << 63) - 1),
        ignore_eos=_bool("ignore_eos", _given(body, "ignore_eos", False)),
        skip_special_tokens=_bool("skip_special_tokens", _given(body, "skip_special_tokens", True)))
    return sampling, _int("n", _given(body, "n", 1), 1, MAX_N)


def _model(body: dict) -> str:
    model = body.get("model")
    if type(model) is not str or not model:
        raise OpenAIError(f"'model' must be a non-empty string (any name: the server serves one model), got "
                          f"{shown(model)}", "model")
    return model


def _prompts(raw: Any) -> list[Union[str, list[int]]]:
    """OpenAI's prompt forms: a string, a list of strings, a list of token ids, a list of lists of token ids."""
    def is_ids(value: Any) -> bool:
        return isinstance(value, list) and bool(value) and all(type(t) is int and t >= 0 for t in value)

    if isinstance(raw, str) and raw:
        return [raw]
    if is_ids(raw):
        return [raw]
    if isinstance(raw, list) and raw and all((isinstance(p, str) and p) or is_ids(p) for p in raw):
        return list(raw)
    raise OpenAIError(f"'prompt' must be a non-empty string, a list of them, a list of token ids or a list of such "
                      f"lists, got {shown(raw)}", "prompt")


def parse_messages(raw: Any) -> list[dict[str, Any]]:
    """OpenAI chat messages as a chat template takes them: {"role", "content": str} (text parts joined; "developer"
    is "system"), an assistant's `tool_calls` as [{"id", "type": "function", "function": {"name", "arguments":
    object}}], a tool result's `tool_call_id`, and `name` where given."""
    if not isinstance(raw, list) or not raw:
        raise OpenAIError(f"'messages' must be a non-empty list of messages, got {shown(raw)}", "messages")
    return [_message(m, f"messages[{i}]") for i, m in enumerate(raw)]


def _message(raw: Any, where: str) -> dict[str, Any]:
    raw = _object(raw, where)
    role = raw.get("role")
    if role not in ROLES:
        raise OpenAIError(f"{where}.role must be one of {', '.join(ROLES)}, got {shown(role)}", f"{where}.role")
    known = {"role", "content", "name", *(("tool_calls",) if role == "assistant" else ()),
             *(("tool_call_id",) if role == "tool" else ()), *_NULL_MESSAGE_KEYS}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise OpenAIError(f"{where} ({role}) has unknown field(s) {unknown}; valid: {sorted(known)}", where)
    for key in _NULL_MESSAGE_KEYS:
        if raw.get(key) not in (None, []):
            raise OpenAIError(f"{where}.{key} is not supported (only null)", f"{where}.{key}")
    tool_calls = _tool_calls(raw.get("tool_calls"), where) if role == "assistant" else []
    content = raw.get("content")
    if content is None and not tool_calls:
        raise OpenAIError(f"{where}.content is required (null only for an assistant message with tool_calls)",
                          f"{where}.content")
    message: dict[str, Any] = {"role": "system" if role == "developer" else role,
                               "content": _text_content(content, f"{where}.content")}
    if raw.get("name") is not None:
        message["name"] = _str(f"{where}.name", raw["name"])
    if tool_calls:
        message["tool_calls"] = tool_calls
    if role == "tool":
        message["tool_call_id"] = _str(f"{where}.tool_call_id", raw.get("tool_call_id"))
    return message


def _text_content(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            part = _object(part, f"{where}[{i}]")
            if part.get("type") != "text" or type(part.get("text")) is not str:
                raise OpenAIError(f"{where}[{i}] must be a text part {{'type': 'text', 'text': ...}} (the model reads "
                                  f"text only), got {shown(part)}", where)
            texts.append(part["text"])
        return "".join(texts)
    raise OpenAIError(f"{where} must be a string or a list of text parts, got {shown(content)}", where)


def _tool_calls(raw: Any, where: str) -> list[dict[str, Any]]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise OpenAIError(f"{where}.tool_calls must be a list, got {shown(raw)}", f"{where}.tool_calls")
    calls = []
    for i, call in enumerate(raw):
        at = f"{where}.tool_calls[{i}]"
        call = _object(call, at)
        function = _object(call.get("function"), f"{at}.function")
        if call.get("type", "function") != "function":
            raise OpenAIError(f"{at}.type must be 'function', got {shown(call.get('type'))}", f"{at}.type")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as e:
                raise OpenAIError(f"{at}.function.arguments is not valid JSON ({e.msg}): {shown(arguments)}",
                                  f"{at}.function.arguments") from None
        calls.append({"id": _str(f"{at}.id", call.get("id", "")), "type": "function",
                      "function": {"name": _str(f"{at}.function.name", function.get("name")),
                                   "arguments": _object(arguments, f"{at}.function.arguments")}})
    return calls


def _tools(raw: Any) -> list[dict[str, Any]]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise OpenAIError(f"'tools' must be a list of function tools, got {shown(raw)}", "tools")
    tools, names = [], set()
    for i, tool in enumerate(raw):
        at = f"tools[{i}]"
        tool = _object(tool, at)
        if tool.get("type") != "function":
            raise OpenAIError(f"{at}.type must be 'function', got {shown(tool.get('type'))}", f"{at}.type")
        function = dict(_object(tool.get("function"), f"{at}.function"))
        name = _str(f"{at}.function.name", function.get("name"))
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise OpenAIError(f"{at}.function.name must be 1-64 letters, digits, _ . or -, got {shown(name)}",
                              f"{at}.function.name")
        if name in names:
            raise OpenAIError(f"{at}: a second tool named {name!r}", f"{at}.function.name")
        if "parameters" in function:
            _object(function["parameters"], f"{at}.function.parameters")
        names.add(name)
        tools.append({"type": "function", "function": function})
    return tools


def _refuse_unknown(body: dict, valid: set[str]) -> None:
    unknown = sorted(set(body) - valid)
    if unknown:
        raise OpenAIError(f"unknown field(s) {unknown}; valid: {', '.join(sorted(valid))}", unknown[0],
                          "unknown_parameter")


def _given(body: dict, key: str, default: Any) -> Any:
    value = body.get(key)
    return default if value is None else value


def _object(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise OpenAIError(f"{where} must be a JSON object, got {shown(value)}", where)
    return value


def _str(name: str, value: Any) -> str:
    if type(value) is not str:
        raise OpenAIError(f"'{name}' must be a string, got {shown(value)}", name)
    return value


def _checked(check, name: str, *args) -> Any:
    try:
        return check(name, *args)
    except RequestRejected as e:
        raise OpenAIError(str(e), name) from None


def _int(name: str, value: Any, minimum: Optional[int] = None, maximum: Optional[int] = None) -> int:
    return _checked(check_int, name, value, minimum, maximum)


def _number(name: str, value: Any) -> float:
    return _checked(check_number, name, value)


def _bool(name: str, value: Any) -> bool:
    return _checked(check_bool, name, value)


# ----------------------------------------------------------------------------------------------- chat template


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


# ----------------------------------------------------------------------------------------------- replies


@dataclass
class Generation:
    """One sample: its tokens and their logprobs, and why it ended ("stop": EOS, a stop token or string; "length")."""

    output_ids: list[int]
    logprobs: list[float]
    finish: str


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


def generated_text(tokenizer, generation: Generation, sampling: Sampling) -> str:
    """The reply's text: special tokens skipped (unless the request says otherwise), a matched stop string cut off
    with whatever came after it in the same token."""
    text = tokenizer.decode(generation.output_ids, skip_special_tokens=sampling.skip_special_tokens)
    if generation.finish == "stop" and sampling.stop:
        found = [text.find(s) for s in sampling.stop if s in text]
        if found:
            text = text[: min(found)]
    return text


def _token_logprobs(tokenizer, generation: Generation) -> list[tuple[str, float]]:
    return [(tokenizer.decode([t]), lp) for t, lp in zip(generation.output_ids, generation.logprobs)]


def chat_completion_reply(request: ChatRequest, tokenizer, prompt_ids: list[int], generations: list[Generation],
                          completion_id: Optional[str] = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the `chat.completion` object, each choice's assistant message as `parse_messages` would give it back)."""
    choices, messages = [], []
    for index, generation in enumerate(generations):
        text = generated_text(tokenizer, generation, request.sampling)
        content, calls = (parse_tool_calls(text, request.tool_names, not request.parallel_tool_calls)
                          if request.tools else (text, []))
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        logprobs = None
        if request.logprobs:
            logprobs = {"content": [{"token": token, "logprob": lp, "bytes": list(token.encode()), "top_logprobs": []}
                                    for token, lp in _token_logprobs(tokenizer, generation)], "refusal": None}
        choices.append({"index": index, "message": message, "logprobs": logprobs,
                        "finish_reason": "tool_calls" if calls else generation.finish})
        messages.append(_message(message, f"choices[{index}].message"))
    reply = {"id": completion_id or f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
             "created": int(time.time()), "model": request.model, "choices": choices,
             "usage": _usage(len(prompt_ids), generations), "system_fingerprint": None}
    return reply, messages


def completion_reply(request: CompletionRequest, tokenizer, prompt_lengths: list[int],
                     generations: list[list[Generation]], completion_id: Optional[str] = None) -> dict[str, Any]:
    """The `text_completion` object: `generations[i]` are prompt i's n samples (choice index i * n + j)."""
    choices = []
    for i, samples in enumerate(generations):
        for j, generation in enumerate(samples):
            logprobs = None
            if request.logprobs:
                pairs = _token_logprobs(tokenizer, generation)
                offsets, at = [], 0
                for token, _ in pairs:
                    offsets.append(at)
                    at += len(token)
                logprobs = {"tokens": [t for t, _ in pairs], "token_logprobs": [lp for _, lp in pairs],
                            "top_logprobs": None, "text_offset": offsets}
            choices.append({"index": i * request.n + j, "text": generated_text(tokenizer, generation, request.sampling),
                            "logprobs": logprobs, "finish_reason": generation.finish})
    usage = _usage(0, [g for samples in generations for g in samples])
    usage["prompt_tokens"] = sum(prompt_lengths)
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    return {"id": completion_id or f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": request.model, "choices": choices, "usage": usage}


def _usage(prompt_tokens: int, generations: list[Generation]) -> dict[str, int]:
    completion_tokens = sum(len(g.output_ids) for g in generations)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def models_reply(model_id: str, context_length: Optional[int] = None) -> dict[str, Any]:
    entry = {"id": model_id, "object": "model", "created": 0, "owned_by": "areal-pipeline", "root": model_id}
    if context_length:
        entry["max_model_len"] = context_length
    return {"object": "list", "data": [entry]}


# ----------------------------------------------------------------------------------------------- the CPU server


def openai_errors(handler):
    """Answer a /v1 handler's refused request in OpenAI's error shape rather than SGLang's."""
    @functools.wraps(handler)
    async def wrapped(self, request: web.Request) -> web.Response:
        try:
            return await handler(self, request)
        except RequestRejected as e:
            error = as_openai_error(e)
            return web.json_response(error.body(), status=error.status)
    return wrapped


class OpenAIRoutes:
    """The CPU inference server's `/v1` routes, on its engine (`server.InferenceServer`: `engine`, `_tokenizing`,
    `_require_ready`). A generation interrupted by a weight update (`/pause_generation`) goes on after
    `/continue_generation` under the new weights, as the project's client resumes SGLang's: the reply is whole."""

    def __init__(self, server):
        self.server = server

    def register(self, router: web.UrlDispatcher) -> None:
        router.add_post("/v1/chat/completions", self.chat_completions)
        router.add_post("/v1/completions", self.completions)
        router.add_get("/v1/models", self.models)

    def _not_ready(self) -> Optional[web.Response]:
        refused = self.server._require_ready()
        if refused is None:
            return None
        message = json.loads(refused.text)["error"]["message"]
        return web.json_response(error_body(message, "service_unavailable"), status=refused.status)

    @openai_errors
    async def chat_completions(self, request: web.Request) -> web.Response:
        if (refused := self._not_ready()) is not None:
            return refused
        chat = parse_chat_request(await read_json_object(request))
        engine = self.server.engine
        prompt_ids = await asyncio.get_running_loop().run_in_executor(
            self.server._tokenizing, lambda: chat_prompt_ids(engine.tokenizer, chat.messages, chat.tools,
                                                             chat.template_kwargs))
        generations = await self._generate(prompt_ids, chat.sampling, chat.n)
        reply, _ = chat_completion_reply(chat, engine.tokenizer, prompt_ids, generations)
        return web.json_response(reply)

    @openai_errors
    async def completions(self, request: web.Request) -> web.Response:
        if (refused := self._not_ready()) is not None:
            return refused
        completion = parse_completion_request(await read_json_object(request))
        engine = self.server.engine
        budget = completion.sampling.max_tokens
        prompts = await asyncio.get_running_loop().run_in_executor(
            self.server._tokenizing, lambda: [p if isinstance(p, list) else engine.tokenize(p, budget)
                                              for p in completion.prompts])
        generations = await asyncio.gather(*(self._generate(ids, completion.sampling, completion.n) for ids in prompts))
        return web.json_response(completion_reply(completion, engine.tokenizer, [len(p) for p in prompts],
                                                  list(generations)))

    async def models(self, request: web.Request) -> web.Response:
        engine = self.server.engine
        return web.json_response(models_reply(engine.model_path, engine.context_length if engine.ready.is_set()
                                              else None))

    async def _generate(self, prompt_ids: list[int], sampling: Sampling, n: int) -> list[Generation]:
        """n samples of one prompt, submitted together (the engine prefills the shared prompt once); a sample that a
        pause interrupted is sent again with its tokens so far and the rest of its budget."""
        from areal_pipeline.inference.engine import GenRequest, SamplingParams

        engine = self.server.engine
        # without max_tokens, the room left: prompt + budget must stay below the context length (as SGLang checks)
        budget = sampling.max_tokens if sampling.max_tokens is not None else engine.context_length - 1 - len(prompt_ids)
        if budget < 1:
            raise OpenAIError(f"the prompt has {len(prompt_ids)} tokens: no room is left to generate in the model's "
                              f"maximum context length of {engine.context_length} tokens", "messages",
                              "context_length_exceeded")
        samples = [Generation([], [], "abort") for _ in range(n)]
        loop = asyncio.get_running_loop()
        while pending := [(i, s) for i, s in enumerate(samples)
                          if s.finish == "abort" and len(s.output_ids) < budget]:
            requests, futures = [], []
            for i, sample in pending:
                params = SamplingParams.from_json(sampling.sglang_params(budget - len(sample.output_ids), i))
                future = loop.create_future()
                gen = GenRequest(input_ids=prompt_ids + sample.output_ids, params=params, return_logprob=True,
                                 on_finish=lambda r, f=future: loop.call_soon_threadsafe(_resolve, f, r))
                engine.validate(gen)
                requests.append(gen)
                futures.append(future)
            for gen in requests:
                engine.submit(gen)
            try:
                await asyncio.gather(*futures)
            except asyncio.CancelledError:  # the client went away: free the batch slots
                for gen in requests:
                    engine.abort(rid=gen.rid)
                raise
            failed = next((gen for gen in requests if gen.error is not None), None)
            if failed is not None:
                raise OpenAIError(failed.error, code="internal_error", status=500, error_type="server_error")
            for (_, sample), gen in zip(pending, requests):
                sample.output_ids += gen.output_ids
                sample.logprobs += gen.output_logprobs
                reason = gen.finish_reason
                if reason["type"] != "abort":
                    sample.finish = reason["type"]
                elif reason.get("message") != PAUSED_FOR_WEIGHT_UPDATE:
                    raise OpenAIError(f"the generation was aborted: {reason.get('message')}", code="aborted",
                                      status=503, error_type="service_unavailable")
        for sample in samples:
            if sample.finish == "abort":  # interrupted just as its budget ran out
                sample.finish = "length"
        return samples


def _resolve(future: asyncio.Future, result: Any) -> None:
    if not future.done():
        future.set_result(result)

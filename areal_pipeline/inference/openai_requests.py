"""OpenAI's `/v1/chat/completions` and `/v1/completions` request bodies, checked: OpenAIError (HTTP 400 in OpenAI's
error shape) naming the field otherwise.

Sampling (into the one `SamplingParams`, types.py): `temperature`, `top_p`, `seed`, `stop` (a string or a list; the
matched stop string is cut from the text), `max_tokens` or `max_completion_tokens` (chat default: the rest of the
context; completions: 16, as OpenAI), `n` (samples of one prompt, prefilled once), `logprobs` (each generated
token's logprob: chat `logprobs=true`, completions `logprobs=0`), and SGLang's extra fields `top_k`, `min_p`,
`stop_token_ids`, `ignore_eos`, `skip_special_tokens` and `chat_template_kwargs`. What would need another sampler or
decoder is refused with HTTP 400 naming the field: `stream=true`, `top_logprobs` > 0 (completions `logprobs` > 0),
non-zero penalties, `logit_bias`, `response_format` other than text, `tool_choice` "required" or a named function,
`echo`, `suffix`. Fields that do not change generation (`user`, `metadata`, `store`, `service_tier`,
`parallel_tool_calls`, `stream_options`) are taken when of OpenAI's type (request_validation.py); any other field is
refused, naming the valid ones.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from areal_pipeline.http_json import RequestRejected, check_bool, check_int, check_number, shown
from areal_pipeline.inference.openai_errors import OpenAIError
from areal_pipeline.inference.request_validation import check_unused_fields, given_max_tokens
from areal_pipeline.inference.types import SamplingParams


# What the server takes: more samples of one prompt than a batch of the CPU server holds would only queue.
MAX_N = 128
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's (and SGLang's) default for /v1/completions

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


@dataclass
class ChatRequest:
    model: str
    messages: list[dict[str, Any]]  # as the chat template takes them (see `parse_messages`)
    tools: Optional[list[dict[str, Any]]]  # None: no tools rendered (none declared, or tool_choice "none")
    sampling: SamplingParams  # max_new_tokens None: up to the end of the context
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
    sampling: SamplingParams  # max_new_tokens None: up to the end of the context
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


def _sampling(body: dict, default_max_tokens: Optional[int]) -> tuple[SamplingParams, int]:
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
    sampling = SamplingParams(
        max_new_tokens=default_max_tokens if given_max is None else given_max,
        temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, stop=stop, stop_token_ids=stop_token_ids,
        sampling_seed=None if seed is None else _int("seed", seed, -(1 << 63), (1 << 63) - 1),
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
    return [parse_message(m, f"messages[{i}]") for i, m in enumerate(raw)]


def parse_message(raw: Any, where: str) -> dict[str, Any]:
    """One message as `parse_messages` gives it; `where` names it in an error."""
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

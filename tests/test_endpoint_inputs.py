"""Bad input on the control endpoints, against the real servers as subprocesses: the CPU inference server (SGLang's
native routes, its weight-update group, the OpenAI /v1 routes) and the trainer's `/command`. Every deterministic
error is a 4xx naming the field, never a 500; the client and the pipeline do not retry it; and after each one the
server still serves, with its weights untouched."""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import threading
import time

import pytest
import torch

from areal_pipeline import auth
from areal_pipeline.errors import is_transient
from areal_pipeline.inference.client import InferenceServerError, RemoteSGLangEngine
from areal_pipeline.inference.server_args import DEFAULT_MAX_BODY_BYTES
from areal_pipeline.run_spec import load_config
from areal_pipeline.training.client import TrainerError, launch_trainer
from areal_pipeline.training.command_input import MAX_COMMAND_BYTES
from areal_pipeline.training.weight_group import destroy_weight_group, host_weight_group
from areal_pipeline.utils import find_free_port
from conftest import http as call, start_cpu_server

PROMPT = [258, 117, 115, 101, 114, 10, 51, 43, 52, 61]
GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
NORM = "model.norm.weight"  # a small tensor to push: its values are visible through /get_weights_by_name
EMBED = "model.embed_tokens.weight"
GROUP = "weight_update_group"
HIDDEN, VOCAB = 128, 259  # the tiny model's (areal_pipeline/model.py)


def message(reply) -> str:
    """The error message of either reply shape: SGLang's {"error": {"message"}} or {"success": false, "message"}."""
    assert isinstance(reply, dict), reply
    return reply["error"]["message"] if "error" in reply else reply["message"]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    """The module's one server (its own: a test joins it to a weight-update group and pushes weights)."""
    process = start_cpu_server(tiny_model_dir, tmp_path_factory.mktemp("endpoint-inputs-server"))
    yield process.address
    process.stop()


def served(address: str) -> tuple[list[int], list[float], str]:
    """What the server serves: a greedy answer, the head of the norm weights and the weight version."""
    status, reply = call(address, "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY})
    assert status == 200, reply
    status, head = call(address, "/get_weights_by_name", {"name": NORM, "truncate_size": 8})
    assert status == 200, head
    return reply["output_ids"], head, call(address, "/get_model_info")[1]["weight_version"]


@pytest.fixture(scope="module")
def before(server):
    return served(server)


@pytest.fixture(scope="module")
def weight_group(server):
    """This test process as the trainer (rank 0) of a gloo weight-update group the server joins as rank 1."""
    port = find_free_port()
    hosted: dict = {}
    host = threading.Thread(target=lambda: hosted.update(
        zip(("group", "store"), host_weight_group("gloo", "127.0.0.1", port, 2, GROUP))))
    host.start()
    status, reply = call(server, "/init_weights_update_group",
                         {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
                          "backend": "gloo", "group_name": GROUP}, timeout=120)
    host.join(120)
    assert status == 200 and not host.is_alive() and "group" in hosted, reply
    yield hosted["group"]
    call(server, "/destroy_weights_update_group", {"group_name": GROUP})
    destroy_weight_group(hosted["group"])


# ----- /generate ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("body, status, fragment", [
    # SGLang streams and returns top logprobs; the CPU server does neither and says so rather than ignoring them
    ({"input_ids": PROMPT, "stream": True}, 400, "stream=true is not supported"),
    ({"input_ids": PROMPT, "stream": "false"}, 400, "'stream' must be true or false"),
    ({"input_ids": PROMPT, "return_logprob": True, "top_logprobs_num": 3}, 400, "top_logprobs_num > 0 is not"),
    ({"input_ids": PROMPT, "top_logprobs_num": -1}, 400, "'top_logprobs_num' must be an integer >= 0"),
    ({"input_ids": PROMPT, "top_logprobs_num": 2.0}, 400, "'top_logprobs_num' must be an integer >= 0"),
    ({"input_ids": PROMPT, "sampling_params": {"temperature": float("nan")}}, 400, "'temperature' must be a finite"),
    ({"input_ids": PROMPT, "sampling_params": {"top_p": float("inf")}}, 400, "'top_p' must be a finite number"),
    ({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": [8]}}, 400, "'max_new_tokens' must be an integer"),
    ({"input_ids": PROMPT, "sampling_params": {"stop_token_ids": ["2"]}}, 400, "'stop_token_ids' must be a list"),
    ({"input_ids": [[1, 2], [3]], "rid": ["a", 7]}, 400, "'rid' must be a string, got 7"),
    ({"input_ids": [[1, 2], [3]], "rid": ["a", "a"]}, 400, "Duplicate request IDs"),
    ({"input_ids": PROMPT, "logprob_start_len": "0"}, 400, "'logprob_start_len' must be an integer >= -1"),
    ({"input_ids": [-1, 2]}, 400, "input_ids must be integers in [0, 259)"),
    ({"text": ["fine", None]}, 400, "text must be a string or a non-empty list of strings"),
])
def test_generate_refuses_bad_input_by_name(server, before, body, status, fragment):
    got, reply = call(server, "/generate", body)
    assert got == status and fragment in message(reply), reply
    assert served(server) == before


# ----- the weight-update group ----------------------------------------------------------------------------------

def good_push(names=(NORM,), dtypes=("float32",), shapes=((HIDDEN,),)) -> dict:
    return {"names": list(names), "dtypes": list(dtypes), "shapes": [list(s) for s in shapes], "group_name": GROUP}


@pytest.mark.parametrize("changes, fragment", [
    ({"names": None}, "'names' is required"),
    ({"dtypes": None}, "'dtypes' is required"),
    ({"shapes": None}, "'shapes' is required"),
    ({"names": NORM}, "'names' must be a list of strings"),
    ({"names": [5]}, "'names' must be a list of strings"),
    ({"dtypes": "float32"}, "'dtypes' must be a list of strings"),
    ({"shapes": [HIDDEN]}, "'shapes' must be a list of lists of non-negative integers"),
    ({"shapes": [[-HIDDEN]]}, "'shapes' must be a list of lists of non-negative integers"),
    ({"shapes": [[str(HIDDEN)]]}, "'shapes' must be a list of lists of non-negative integers"),
    ({"shapes": [[float(HIDDEN)]]}, "'shapes' must be a list of lists of non-negative integers"),
    ({"dtypes": ["float32", "float32"]}, "got 1 names, 2 dtypes and 1 shapes"),
    ({"weight_version": {"v": 1}}, "'weight_version' must be a string"),
    ({"abort_all_requests": "no"}, "'abort_all_requests' must be true or false"),
    ({"flush_cache": 1}, "'flush_cache' must be true or false"),
    ({"group_name": 5}, "'group_name' must be a string"),
    ({"group_name": "other"}, "Group other not in"),
    # checked against the model: a tensor it lacks, an unknown dtype, a wrong shape
    ({"names": ["model.no_such.weight"]}, "names[0]: this model has no tensor 'model.no_such.weight'"),
    ({"dtypes": ["float64"]}, "dtypes[0]: unknown dtype 'float64'"),
    ({"shapes": [[HIDDEN + 1]]}, f"shapes[0]: {NORM} has shape [{HIDDEN}], not [{HIDDEN + 1}]"),
    ({"shapes": [[8, 16]]}, f"shapes[0]: {NORM} has shape [{HIDDEN}], not [8, 16]"),
    # the first tensor fits and the second does not: the server must not take the first and then wait for the
    # second (or hold half an update), it refuses both before receiving anything
    (good_push((NORM, EMBED), ("float32", "int8"), ((HIDDEN,), (VOCAB, HIDDEN))), "dtypes[1]: unknown dtype 'int8'"),
    (good_push((NORM, EMBED), ("float32", "float32"), ((HIDDEN,), (HIDDEN, VOCAB))), f"shapes[1]: {EMBED} has shape"),
])
def test_a_bad_weight_push_is_refused_before_anything_is_received(server, before, weight_group, changes, fragment):
    body = {**good_push(), **changes}
    body = {k: v for k, v in body.items() if v is not None}
    started = time.monotonic()
    status, reply = call(server, "/update_weights_from_distributed", body, timeout=60)
    assert status == 400 and fragment in message(reply), reply
    assert time.monotonic() - started < 30  # refused at once: it did not wait on a broadcast that never comes
    assert served(server) == before


@pytest.mark.parametrize("changes, fragment", [
    ({"master_address": None}, "'master_address' is missing"),
    ({"master_port": "x"}, "'master_port' must be an integer in [1, 65535], got 'x'"),
    ({"master_port": 70000}, "'master_port' must be an integer in [1, 65535]"),
    ({"master_port": 1.5}, "'master_port' must be an integer in [1, 65535]"),
    ({"rank_offset": 0}, "'rank_offset' must be an integer >= 1"),
    ({"world_size": 1}, "'world_size' must be an integer >= 2"),  # would wait out the group timeout for no one
    ({"world_size": True}, "'world_size' must be an integer"),
    ({"backend": "mpi"}, "unknown weight-update backend 'mpi'"),
    ({"backend": 5}, "'backend' must be a string"),
])
def test_a_bad_group_join_is_refused_at_once(server, changes, fragment):
    body = {"master_address": "127.0.0.1", "master_port": find_free_port(), "rank_offset": 1, "world_size": 2,
            "group_name": "never-joined", **changes}
    body = {k: v for k, v in body.items() if v is not None}
    status, reply = call(server, "/init_weights_update_group", body, timeout=60)
    assert status == 400 and fragment in message(reply), reply
    assert call(server, "/health")[0] == 200


def test_the_group_still_updates_after_bad_pushes(server, before, weight_group):
    """The bad pushes above left the group usable: a good one after them lands exactly (then the old norm goes
    back)."""
    new_norm = torch.linspace(-1.0, 1.0, HIDDEN)
    original = torch.tensor(call(server, "/get_weights_by_name", {"name": NORM, "truncate_size": HIDDEN})[1])
    for tensor, version in ((new_norm, "7"), (original, before[2])):
        replies: list = []
        poster = threading.Thread(target=lambda: replies.append(call(
            server, "/update_weights_from_distributed", {**good_push(), "weight_version": version}, timeout=120)))
        poster.start()
        weight_group.broadcast(tensor.clone(), root=0).wait()
        poster.join(120)
        assert replies and replies[0][0] == 200, replies
        got = torch.tensor(call(server, "/get_weights_by_name", {"name": NORM, "truncate_size": HIDDEN})[1])
        assert torch.equal(got, tensor) and served(server)[2] == version
    assert served(server) == before


# ----- /v1 (OpenAI's error shape: the field is its `param`) -------------------------------------------------------

CHAT = {"model": "m", "messages": [{"role": "user", "content": "2+3?"}], "max_tokens": 4}
COMPLETION = {"model": "m", "prompt": "2+3=", "max_tokens": 4}


@pytest.mark.parametrize("path, changes, param, fragment", [
    ("/v1/chat/completions", {"temperature": float("nan")}, "temperature", "'temperature' must be a finite number"),
    ("/v1/chat/completions", {"top_p": float("-inf")}, "top_p", "'top_p' must be a finite number"),
    ("/v1/completions", {"presence_penalty": float("inf")}, "presence_penalty", "must be a finite number"),
    ("/v1/completions", {"seed": float("nan")}, "seed", "'seed' must be an integer"),
    ("/v1/chat/completions", {"max_tokens": "4"}, "max_tokens", "'max_tokens' must be an integer >= 1, got '4'"),
    ("/v1/chat/completions", {"max_completion_tokens": "4"}, "max_completion_tokens",
     "'max_completion_tokens' must be an integer >= 1, got '4'"),
    ("/v1/chat/completions", {"max_completion_tokens": 5}, "max_completion_tokens", "disagree: give one"),
    ("/v1/completions", {"n": 1.0}, "n", "'n' must be an integer in [1, 128]"),
    ("/v1/chat/completions", {"logprobs": 1}, "logprobs", "'logprobs' must be true or false"),
    ("/v1/chat/completions", {"stream": True}, "stream", "stream=true is not supported"),
    ("/v1/chat/completions", {"logit_bias": {"42": 100}}, "logit_bias", "logit_bias is not supported"),
    ("/v1/completions", {"logit_bias": [1]}, "logit_bias", "logit_bias is not supported"),
    ("/v1/completions", {"suffix": " end"}, "suffix", "suffix is not supported"),
    ("/v1/completions", {"echo": "no"}, "echo", "'echo' must be true or false"),
    # taken without changing the generation, but only when of OpenAI's type
    ("/v1/chat/completions", {"user": 5}, "user", "'user' must be a string"),
    ("/v1/completions", {"service_tier": ["auto"]}, "service_tier", "'service_tier' must be a string"),
    ("/v1/chat/completions", {"store": "yes"}, "store", "'store' must be true or false"),
    ("/v1/chat/completions", {"metadata": {"run": 1}}, "metadata", "'metadata' must be an object of strings"),
    ("/v1/completions", {"stream_options": "usage"}, "stream_options", "'stream_options' must be an object"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content",
     "messages[0].content must be a string or a list of text parts"),
    ("/v1/completions", {"prompt": [1, 2.5]}, "prompt", "'prompt' must be a non-empty string"),
])
def test_v1_refuses_bad_input_in_openai_error_shape(server, before, path, changes, param, fragment):
    body = {**(CHAT if path == "/v1/chat/completions" else COMPLETION), **changes}
    status, reply = call(server, path, body)
    assert status == 400, reply
    error = reply["error"]
    assert error["param"] == param and fragment in error["message"] and error["type"] == "invalid_request_error"
    assert served(server) == before


def test_v1_takes_the_unused_fields_when_well_typed(server):
    body = {**CHAT, "user": "u1", "metadata": {"run": "a"}, "store": False, "service_tier": "auto",
            "stream_options": None, "logit_bias": {}}
    status, reply = call(server, "/v1/chat/completions", body)
    assert status == 200 and reply["usage"]["completion_tokens"] <= 4, reply


def post_declaring(address: str, path: str, declared: int) -> tuple[int, dict]:
    """(status, JSON reply) of a POST that declares `declared` body bytes and sends two: a body over a limit is
    refused on its declared size, unread."""
    host, port = address.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        connection.putrequest("POST", path)
        connection.putheader("Content-Type", "application/json")
        connection.putheader("Content-Length", str(declared))
        for name, value in auth.auth_headers().items():
            connection.putheader(name, value)
        connection.endheaders(b"{}")
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/v1/chat/completions",
                                  "/update_weights_from_distributed", "/init_weights_update_group", "/abort_request"])
def test_bodies_over_the_limit_are_413_on_every_route_that_reads_one(server, before, path):
    limit = DEFAULT_MAX_BODY_BYTES
    status, reply = post_declaring(server, path, limit + 1)
    assert status == 413 and f"the limit is {limit}" in message(reply), reply
    assert served(server) == before


def test_wrong_methods_and_routes_are_405_and_404(server):
    for method, path, status in [("GET", "/generate", 405), ("GET", "/update_weights_from_distributed", 405),
                                 ("GET", "/v1/chat/completions", 405), ("POST", "/health", 405),
                                 ("POST", "/v1/nowhere", 404)]:
        host, port = server.rsplit(":", 1)
        connection = http.client.HTTPConnection(host, int(port), timeout=60)
        try:
            connection.request(method, path, body=b"{}" if method == "POST" else None,
                               headers={"Content-Type": "application/json", **auth.auth_headers()})
            assert connection.getresponse().status == status, (method, path)
        finally:
            connection.close()


# ----- the client side: a 4xx is not retried, nor classed as transient --------------------------------------------

def test_the_client_does_not_retry_a_4xx(server):
    """With a retry delay longer than the deadline, a retried 400 could not come back in time."""
    async def bad_generate():
        engine = RemoteSGLangEngine([server], request_retries=3, retry_delay=60.0)
        try:
            return await asyncio.wait_for(engine.request(server, "/generate", {"input_ids": PROMPT, "stream": True}),
                                          timeout=30)
        finally:
            await engine.close()

    with pytest.raises(InferenceServerError, match="stream=true is not supported") as refused:
        asyncio.run(bad_generate())
    assert refused.value.status == 400 and not is_transient(refused.value)


# ----- the trainer's /command -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trainer(tiny_model_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("endpoint-inputs-trainer")
    cfg = load_config(None, [f"output_dir={run_dir}", "total_iterations=2"])
    process, client = launch_trainer(cfg, str(tiny_model_dir), run_dir)
    client.output_dir = str(run_dir)  # where its commands' paths may lie (confined_paths.py)
    yield client
    process.stop()


def trainer_run_dir(trainer) -> str:
    return trainer.output_dir


def post_command(address: str, data: bytes, headers: dict[str, str]) -> tuple[int, dict]:
    host, port = address.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        connection.request("POST", "/command", body=data, headers={**headers, **auth.auth_headers()})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


@pytest.mark.parametrize("command, status, fragment", [
    ({"cmd": "train", "batch_dir": "/nowhere", "iteration": "1"}, 400, "'iteration' must be an integer, got '1'"),
    ({"cmd": "train", "batch_dir": 5, "iteration": 1}, 400, "'batch_dir' must be a string, got 5"),
    ({"cmd": "train", "batch_dir": "/nowhere", "iteration": True}, 400, "'iteration' must be an integer"),
    ({"cmd": "train", "batch_dir": "/nowhere"}, 400, "missing argument(s) ['iteration']"),
    ({"cmd": "status", "verbose": True}, 400, "unknown argument(s) ['verbose']"),
    ({"cmd": "probe_logp", "input_ids": "1 2 3"}, 400, "'input_ids' must be a list of integers, got '1 2 3'"),
    ({"cmd": "probe_logp", "input_ids": [1]}, 400, "'input_ids' must be a list of at least 2 token ids"),
    ({"cmd": "save", "path": "/nowhere", "extra": [1]}, 400, "'extra' must be an object or null"),
    ({"cmd": "compute_logp", "shard_dir": "{run}/a", "out_path": "{run}/b", "model": "critic"}, 400,
     "unknown model 'critic'"),
    ({"cmd": "load", "path": "{run}/nowhere/at/all"}, 404, "no checkpoint at {run}/nowhere/at/all"),
    ({"cmd": "load", "path": "/nowhere/at/all"}, 403, "load's 'path' '/nowhere/at/all' is outside the allowed"),
    ({"cmd": "update_weights_distributed", "servers": ["127.0.0.1:1"], "master_address": "127.0.0.1",
      "master_port": 29500, "tp_sizes": [1, 1]}, 400, "'tp_sizes' must hold one size >= 1 per server"),
    ({"cmd": "update_weights_distributed", "servers": ["127.0.0.1:1"], "master_address": "127.0.0.1",
      "master_port": 70000}, 400, "a master_port in [0, 65535] (0: a free one on the master's address)"),
    ({"cmd": "update_weights_distributed", "servers": "127.0.0.1:1", "master_address": "127.0.0.1",
      "master_port": 29500}, 400, "'servers' must be a list of strings"),
    ({"cmd": "update_weights_distributed", "servers": ["127.0.0.1:1"], "master_address": "127.0.0.1",
      "master_port": 29500, "dtype": "float64"}, 400, "weight-sync dtype 'float64' is not one of"),
    ({"cmd": ["status"]}, 400, "unknown command '['status']'"),
])
def test_trainer_refuses_bad_commands_as_permanent(trainer, command, status, fragment):
    run = trainer_run_dir(trainer)
    command = {k: v.replace("{run}", run) if isinstance(v, str) else v for k, v in command.items()}
    fragment = fragment.replace("{run}", run)
    with pytest.raises(TrainerError, match=re.escape(fragment)) as refused:
        trainer.call(command["cmd"], **{k: v for k, v in command.items() if k != "cmd"})
    assert refused.value.status == status, str(refused.value)
    assert not is_transient(refused.value)  # the pipeline's retry condition: a 4xx fails at once
    after = trainer.call("status")
    assert (after["version"], after["initialized"]) == (0, True)


@pytest.mark.parametrize("data, headers, status, fragment", [
    (b"{not json", {}, 400, "the body is not JSON"),
    (b"[1, 2]", {}, 400, "a command is a JSON object, not list"),
    (b"[" * 100_000 + b"]" * 100_000, {}, 400, "nested too deeply"),
    (b"{}", {"Content-Length": "-5"}, 400, "Content-Length '-5' is not a byte count"),
    (b"{}", {"Content-Length": str(MAX_COMMAND_BYTES + 1)}, 413, f"the limit is {MAX_COMMAND_BYTES}"),
    (b"{}", {"Transfer-Encoding": "chunked"}, 411, "a command needs a Content-Length header"),
])
def test_trainer_refuses_bodies_that_are_no_command(trainer, data, headers, status, fragment):
    if "Transfer-Encoding" not in headers:
        headers = {"Content-Length": str(len(data)), **headers}
    got, reply = post_command(trainer.address, data, headers)
    assert got == status and fragment in reply["error"]["message"], reply
    assert trainer.call("status")["initialized"] is True


def test_trainer_routes_and_methods(trainer):
    host, port = trainer.address.rsplit(":", 1)
    for method, path, status in [("GET", "/command", 405), ("POST", "/health", 405), ("POST", "/nowhere", 404),
                                 ("GET", "/nowhere", 404)]:
        connection = http.client.HTTPConnection(host, int(port), timeout=60)
        try:
            connection.request(method, path, body=b"{}" if method == "POST" else None, headers=auth.auth_headers())
            response = connection.getresponse()
            assert response.status == status and path in json.loads(response.read())["error"]["message"]
        finally:
            connection.close()

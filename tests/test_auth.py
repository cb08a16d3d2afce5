"""Every service the project starts takes a request only with the run's token (areal_pipeline/auth.py), against
real processes on loopback: the CPU inference server (SGLang's routes, its weight routes, the OpenAI /v1 routes),
the retrieval server and the trainer's control endpoint answer 401 on every route to a request without it, with a
wrong one or with another scheme, and serve it with it; their bare GET /health says only that they are up. A
service given no credential refuses to start; AREAL_PIPELINE_AUTH=off serves anyone and makes clients send
nothing. The token is in no log of theirs and on no command line."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from areal_pipeline import auth
from areal_pipeline.processes import ServerProcess
from areal_pipeline.utils import find_free_port
from conftest import http as call

pytestmark = pytest.mark.skipif(auth.auth_disabled(), reason="AREAL_PIPELINE_AUTH=off: this session's services "
                                                             "demand no credential")

TOKEN = auth.run_token() or ""  # the session's (conftest.py), which every service a test starts demands
DOCUMENTS = [("Poleconomy", "a board game of politics and economy"),
             ("Kerensky", "a leader of the Socialist Revolutionary Party"),
             ("Loopback", "the address a host calls itself")]
CORPUS = [{"id": str(i), "title": title, "contents": f"{title}\n{text}"} for i, (title, text) in enumerate(DOCUMENTS)]
CREDENTIAL_ENV = (auth.TOKEN_ENV, auth.TOKEN_FILE_ENV, auth.AUTH_ENV)


def other_last_character(token: str) -> str:
    return token[:-1] + ("A" if token[-1] != "A" else "B")


def wrong_credentials(token: str) -> dict[str, str | None]:
    """Authorization headers that must all be refused (None: no header)."""
    return {"none": None, "another token": f"Bearer {auth.new_token()}",
            "the last character differs": f"Bearer {other_last_character(token)}",
            "one character short": f"Bearer {token[:-1]}", "one character more": f"Bearer {token}x",
            "Basic scheme": f"Basic {token}", "no scheme": token, "empty": "", "Bearer alone": "Bearer"}


def raw(address: str, method: str, path: str, authorization: str | None = None, body=None):
    """(status, reply as JSON, text or None, the reply's headers) of one request with exactly this Authorization
    header (None: none)."""
    host, port = address.rsplit(":", 1)
    headers = {} if authorization is None else {"Authorization": authorization}
    data = None
    if body is not None or method == "POST":
        data = json.dumps({} if body is None else body).encode()
        headers["Content-Type"] = "application/json"
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        connection.request(method, path, body=data, headers=headers)
        response = connection.getresponse()
        text = response.read().decode(errors="replace")
        try:
            reply = json.loads(text) if text else None
        except json.JSONDecodeError:
            reply = text
        return response.status, reply, dict(response.getheaders())
    finally:
        connection.close()


def assert_refused_everywhere(address: str, routes: list[tuple[str, str, object]]) -> None:
    for method, path, body in routes:
        for name, header in wrong_credentials(TOKEN).items():
            status, reply, headers = raw(address, method, path, header, body)
            assert status == 401, (method, path, name, status, reply)
            assert headers.get("WWW-Authenticate") == "Bearer", (method, path, name, headers)
            assert "Authorization: Bearer" in reply["error"]["message"], reply
            assert TOKEN not in json.dumps(reply) and TOKEN not in json.dumps(headers)


def bare_health(address: str) -> None:
    """GET /health without the token, or with a wrong one, answers 200 and says nothing but that it is up."""
    for header in (None, f"Bearer {other_last_character(TOKEN)}", f"Basic {TOKEN}"):
        status, reply, _ = raw(address, "GET", "/health", header)
        assert status == 200 and reply in (None, {"status": "ok"}), (header, status, reply)


def clean_env(**more: str) -> dict[str, str]:
    """This process's environment without any credential or the auth switch, and with `more`."""
    env = {k: v for k, v in os.environ.items() if k not in CREDENTIAL_ENV}
    return {**env, **more}


def retrieval_command(corpus: Path, port: int, index_dir: Path) -> list[str]:
    return [sys.executable, "-m", "areal_pipeline.tools.retrieval_server", "--corpus", str(corpus), "--host",
            "127.0.0.1", "--port", str(port), "--index-dir", str(index_dir)]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("auth")
    (work / "corpus.jsonl").write_text("".join(json.dumps(row) + "\n" for row in CORPUS))
    return work


def start_retrieval(work: Path, name: str, env: dict[str, str] | None = None) -> ServerProcess:
    port = find_free_port()
    server = ServerProcess(retrieval_command(work / "corpus.jsonl", port, work / "indexes"), f"127.0.0.1:{port}",
                           work / f"{name}.log", env=env, kind="retrieval server").start()
    try:
        server.wait_healthy(60)
    except BaseException:
        server.stop()
        raise
    return server


@pytest.fixture(scope="module")
def retrieval(work):
    server = start_retrieval(work, "retrieval-server")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def trainer(tiny_model_dir, work):
    from areal_pipeline.run_spec import load_config
    from areal_pipeline.training.client import launch_trainer

    run_dir = work / "trainer"
    cfg = load_config(None, [f"output_dir={run_dir}", "total_iterations=1"])
    process, client = launch_trainer(cfg, str(tiny_model_dir), run_dir)
    yield process, client
    process.stop()


def cpu_server_log(tmp_path_factory, address: str) -> Path:
    """The log of conftest's `cpu_server` (server-<port>.log in its log folder)."""
    port = address.rsplit(":", 1)[1]
    found = {log.resolve() for log in tmp_path_factory.getbasetemp().glob(f"server-logs*/server-{port}.log")}
    assert len(found) == 1, found
    return found.pop()


# ----- (1) every route of every service -----------------------------------------------------------------------

GENERATE = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "temperature": 0}
# (method, path, body, status with the token): the weight routes are sent a body they refuse (400), which only a
# request past the credential check is told; pause comes before continue, which leaves the shared server serving
INFERENCE_ROUTES = [
    ("GET", "/health_generate", None, 200), ("GET", "/get_model_info", None, 200), ("GET", "/model_info", None, 200),
    ("GET", "/get_server_info", None, 200), ("GET", "/server_info", None, 200), ("GET", "/v1/models", None, 200),
    ("POST", "/generate", GENERATE, 200), ("POST", "/v1/chat/completions", CHAT, 200),
    ("POST", "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 1, "temperature": 0}, 200),
    ("POST", "/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": 2}, 200),
    ("GET", "/get_weights_by_name?name=model.norm.weight&truncate_size=2", None, 200),
    ("POST", "/flush_cache", None, 200), ("POST", "/abort_request", {"rid": "no-such-request"}, 200),
    ("POST", "/update_weights_from_disk", {}, 400), ("POST", "/init_weights_update_group", {}, 400),
    ("POST", "/update_weights_from_distributed", {}, 400), ("POST", "/destroy_weights_update_group", {}, 400),
    ("POST", "/pause_generation", {}, 200), ("POST", "/continue_generation", {}, 200),
    ("POST", "/health", None, 405), ("POST", "/nowhere", None, 404), ("GET", "/v1/nowhere", None, 404),
]


def test_the_inference_server_refuses_every_route_without_the_token(cpu_server):
    assert_refused_everywhere(cpu_server, [(m, p, b) for m, p, b, _ in INFERENCE_ROUTES])
    bare_health(cpu_server)
    status, reply, _ = raw(cpu_server, "HEAD", "/health")
    assert status == 200


def test_the_inference_server_serves_every_route_with_the_token(cpu_server):
    for method, path, body, expected in INFERENCE_ROUTES:
        status, reply, _ = raw(cpu_server, method, path, f"Bearer {TOKEN}", body)
        assert status == expected, (method, path, status, reply)
    for header in (f"Bearer {TOKEN}", f"bearer {TOKEN}", f"Bearer  {TOKEN} "):  # the scheme in any case, spaces
        assert raw(cpu_server, "GET", "/get_model_info", header)[0] == 200, header
    assert raw(cpu_server, "GET", "/health", f"Bearer {TOKEN}")[0] == 200
    assert call(cpu_server, "/generate", GENERATE)[0] == 200  # not left paused


def test_the_openai_sdk_needs_the_token_as_its_api_key(cpu_server):
    import openai

    async def models(api_key: str) -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"http://{cpu_server}/v1", api_key=api_key, max_retries=0)
        try:
            return [m.id for m in (await client.models.list()).data]
        finally:
            await client.close()

    assert asyncio.run(models(auth.run_token()))
    with pytest.raises(openai.AuthenticationError) as refused:
        asyncio.run(models("sk-not-the-run-token"))
    assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"


RETRIEVAL_ROUTES = [("POST", "/retrieve", {"queries": ["Poleconomy"], "topk": 1}, 200),
                    ("POST", "/nowhere", None, 404), ("POST", "/health", None, 405)]


def test_the_retrieval_server_refuses_every_route_without_the_token_and_serves_it_with_it(retrieval):
    assert_refused_everywhere(retrieval.address, [(m, p, b) for m, p, b, _ in RETRIEVAL_ROUTES])
    bare_health(retrieval.address)
    for method, path, body, expected in RETRIEVAL_ROUTES:
        status, reply, _ = raw(retrieval.address, method, path, f"Bearer {TOKEN}", body)
        assert status == expected, (method, path, status, reply)
    status, reply, _ = raw(retrieval.address, "POST", "/retrieve", f"Bearer {TOKEN}", RETRIEVAL_ROUTES[0][2])
    assert reply["result"][0][0]["title"] == "Poleconomy"
    assert call(retrieval.address, "/health") == (200, {"status": "ok", "retriever": "bm25", "num_docs": 3})


TRAINER_ROUTES = [("POST", "/command", {"cmd": "status"}, 200), ("GET", "/command", None, 405),
                  ("POST", "/health", None, 405), ("POST", "/nowhere", None, 404), ("GET", "/nowhere", None, 404)]


def test_the_trainer_refuses_every_route_without_the_token_and_serves_it_with_it(trainer):
    process, client = trainer
    assert_refused_everywhere(process.address, [(m, p, b) for m, p, b, _ in TRAINER_ROUTES])
    bare_health(process.address)
    for method, path, body, expected in TRAINER_ROUTES:
        status, reply, _ = raw(process.address, method, path, f"Bearer {TOKEN}", body)
        assert status == expected, (method, path, status, reply)
    status, reply, _ = raw(process.address, "GET", "/health", f"Bearer {TOKEN}")
    assert status == 200 and reply["status"] == "ok" and "busy_with" in reply and len(reply) > 2, reply
    assert raw(process.address, "GET", "/health")[1] == {"status": "ok"}
    assert client.call("status")["initialized"] is True


def test_a_served_judge_is_sent_the_run_token_and_an_external_one_its_own_key(cpu_server, tiny_model_dir, tmp_path,
                                                                            monkeypatch):
    """The judge the run serves (judge.serve) is an inference server: the judge reward asks it with the run's
    token. The same server named as an external judge (judge.base_url) is sent the key judge.api_key_env names,
    and nothing without one: the run's token is never sent to an endpoint the run does not serve."""
    from areal_pipeline.rewards.group import Candidate
    from areal_pipeline.rewards.judge import JudgeRefused, JudgeUnavailable, judge
    from areal_pipeline.rewards.local_judge import served_judge_config
    from areal_pipeline.run_spec import load_config

    candidates = [Candidate("p", k, "What is 1+1?", answer) for k, answer in enumerate(["2", "3"])]
    common = ["rollout.group_reward=judge", "judge.retries=0", "judge.max_tokens=2"]
    served = load_config(None, [f"output_dir={tmp_path / 'served'}", *common, "judge.serve=true",
                                f"judge.model_path={tiny_model_dir}"])
    served = served_judge_config(served, cpu_server)
    assert served.judge.base_url == f"http://{cpu_server}/v1"
    # past the credential: the tiny model's two bytes are no scores JSON, a transient failure, not a refusal
    with pytest.raises(JudgeUnavailable) as unanswered:
        asyncio.run(judge(served).score_group(candidates))
    assert "JudgeAnswerError" in str(unanswered.value) and "401" not in str(unanswered.value), unanswered.value
    external = load_config(None, [f"output_dir={tmp_path / 'external'}", *common,
                                  f"judge.base_url=http://{cpu_server}/v1", "judge.model=m"])
    with pytest.raises(JudgeRefused, match="HTTP 401"):
        asyncio.run(judge(external).score_group(candidates))
    monkeypatch.setenv("AUTH_TEST_JUDGE_KEY", TOKEN)  # an external judge whose key happens to be the token
    keyed = load_config(None, [f"output_dir={tmp_path / 'keyed'}", *common, f"judge.base_url=http://{cpu_server}/v1",
                               "judge.model=m", "judge.api_key_env=AUTH_TEST_JUDGE_KEY"])
    with pytest.raises(JudgeUnavailable, match="JudgeAnswerError"):
        asyncio.run(judge(keyed).score_group(candidates))


# ----- (2) no credential: no service; AREAL_PIPELINE_AUTH=off: anyone ------------------------------------------

def test_a_service_given_no_credential_refuses_to_start(tiny_model_dir, work):
    commands = {
        "inference": [sys.executable, "-m", "areal_pipeline.inference.server", "--model", str(tiny_model_dir),
                      "--host", "127.0.0.1", "--port", str(find_free_port())],
        "retrieval": retrieval_command(work / "corpus.jsonl", find_free_port(), work / "indexes"),
        "trainer": [sys.executable, "-m", "areal_pipeline.training.trainer_server", "--config",
                    str(work / "no-config.yaml"), "--model", str(tiny_model_dir), "--port", "0"],
    }
    env = clean_env()
    env.pop("RANK", None)
    started = {name: subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True) for name, command in commands.items()}
    for name, popen in started.items():
        try:
            out, err = popen.communicate(timeout=120)
        finally:
            popen.kill()
        assert popen.returncode != 0, (name, out, err)
        assert "no credential" in err and auth.TOKEN_FILE_ENV in err and f"{auth.AUTH_ENV}=off" in err, (name, err)
        assert "Traceback" not in err, (name, err)


def test_a_token_file_others_may_read_is_refused_and_one_of_the_owners_serves(work, tmp_path):
    loose = tmp_path / "loose-token"
    loose.write_text("loose-token-value\n")
    loose.chmod(0o644)
    done = subprocess.run(retrieval_command(work / "corpus.jsonl", find_free_port(), work / "indexes"),
                          env=clean_env(**{auth.TOKEN_FILE_ENV: str(loose)}), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode != 0 and "chmod 600" in done.stderr and "loose-token-value" not in done.stderr, done.stderr

    token_file = auth.write_token_file(tmp_path / "secret" / "token", "  file-token-value \n")
    assert token_file.stat().st_mode & 0o777 == 0o600
    server = start_retrieval(work, "retrieval-token-file", clean_env(**{auth.TOKEN_FILE_ENV: str(token_file)}))
    try:
        body = {"queries": ["Kerensky"], "topk": 1}
        assert raw(server.address, "POST", "/retrieve", "Bearer file-token-value", body)[0] == 200
        assert raw(server.address, "POST", "/retrieve", f"Bearer {TOKEN}", body)[0] == 401
    finally:
        server.stop()
    assert "file-token-value" not in server.log_path.read_text()


def test_auth_off_serves_anyone_and_makes_clients_send_nothing(work, retrieval, trainer, monkeypatch):
    server = start_retrieval(work, "retrieval-auth-off", clean_env(**{auth.AUTH_ENV: "off"}))
    try:
        body = {"queries": ["Poleconomy"], "topk": 1}
        status, reply, _ = raw(server.address, "POST", "/retrieve", None, body)
        assert status == 200 and reply["result"][0][0]["title"] == "Poleconomy"
        assert raw(server.address, "POST", "/retrieve", "Bearer anything", body)[0] == 200
        assert raw(server.address, "GET", "/health")[1]["num_docs"] == 3  # nothing to hide from anyone
    finally:
        server.stop()

    from areal_pipeline.tools.retrieval_client import RetrievalClient, RetrievalError
    from areal_pipeline.training.client import TrainerError

    monkeypatch.setenv(auth.AUTH_ENV, "off")  # the laptop switch, in this client: the session's token is not sent
    assert auth.run_token() is None and auth.auth_headers() == {}
    assert "Authorization" not in auth.request(retrieval.address, "/retrieve").headers
    with pytest.raises(RetrievalError, match="401"):
        asyncio.run(RetrievalClient(retrieval.address).retrieve(["Poleconomy"], topk=1))
    process, client = trainer
    with pytest.raises(TrainerError) as refused:
        client.call("status")
    assert refused.value.status == 401
    assert call(retrieval.address, "/retrieve", {"queries": ["x"]})[0] == 401
    assert retrieval.is_healthy() and process.is_healthy()  # the bare probe needs nothing
    monkeypatch.delenv(auth.AUTH_ENV)
    assert client.call("status")["initialized"] is True


# ----- (3) the token file; (4) the comparison --------------------------------------------------------------------

def test_read_token_file(tmp_path):
    path = tmp_path / "token"
    path.write_text("  s3cret-token \n\n")
    path.chmod(0o644)
    with pytest.raises(auth.CredentialError, match=r"mode 0644 lets others read or change it.*chmod 600") as loose:
        auth.read_token_file(path)
    assert "s3cret" not in str(loose.value)
    for mode in (0o640, 0o604, 0o620, 0o602, 0o660):
        path.chmod(mode)
        with pytest.raises(auth.CredentialError, match="chmod 600"):
            auth.read_token_file(path)
    path.chmod(0o600)
    assert auth.read_token_file(path) == "s3cret-token"
    path.chmod(0o400)
    assert auth.read_token_file(path) == "s3cret-token"
    path.chmod(0o600)
    path.write_text(" \n\t\n")
    with pytest.raises(auth.CredentialError, match="is empty"):
        auth.read_token_file(path)
    with pytest.raises(auth.CredentialError, match="cannot read it"):
        auth.read_token_file(tmp_path / "missing")

    written = auth.write_token_file(tmp_path / "new" / "token")
    assert written.stat().st_mode & 0o777 == 0o600 and len(auth.read_token_file(written)) >= 32


def test_the_token_from_the_environment_or_its_file(tmp_path, monkeypatch):
    for name in CREDENTIAL_ENV:
        monkeypatch.delenv(name, raising=False)
    assert auth.run_token() is None and auth.auth_headers() == {}
    with pytest.raises(auth.CredentialError, match=auth.TOKEN_FILE_ENV):
        auth.service_token("a service")
    path = auth.write_token_file(tmp_path / "token", "from-the-file\n")
    monkeypatch.setenv(auth.TOKEN_FILE_ENV, str(path))
    assert auth.service_token("a service") == "from-the-file"
    assert auth.auth_headers() == {"Authorization": "Bearer from-the-file"}
    monkeypatch.setenv(auth.TOKEN_ENV, " from-the-env\n")  # the variable wins over the file
    assert auth.run_token() == "from-the-env"
    for off in ("off", "OFF", "0", "false", "no", "none"):
        monkeypatch.setenv(auth.AUTH_ENV, off)
        assert auth.run_token() is None and auth.service_token("a service") is None and auth.auth_headers() == {}
    monkeypatch.setenv(auth.AUTH_ENV, "on")
    assert auth.run_token() == "from-the-env"


def test_a_token_file_rewritten_is_read_again_and_one_made_unreadable_is_refused(tmp_path, monkeypatch):
    """A client reads the token file again only when it changed: a rotated token (same length, or another) is the
    one its next request sends, and a file someone opened to others is refused at once (a cache kept by mistake
    would go on sending the old one)."""
    for name in CREDENTIAL_ENV:
        monkeypatch.delenv(name, raising=False)
    path = auth.write_token_file(tmp_path / "token", "first-token")
    monkeypatch.setenv(auth.TOKEN_FILE_ENV, str(path))
    assert auth.run_token() == auth.run_token() == "first-token"
    for rotated in ("other-token", "a-longer-rotated-token"):
        before = path.stat().st_mtime_ns
        path.write_text(rotated + "\n")  # rotated in place, still 0600
        os.utime(path, ns=(before + 10**9, before + 10**9))  # a later write, whatever the clock's resolution
        assert auth.auth_headers() == {"Authorization": f"Bearer {rotated}"}
    path.chmod(0o644)
    with pytest.raises(auth.CredentialError, match="lets others read or change it"):
        auth.run_token()


def test_commands_on_one_output_directory_share_its_token_made_once(tmp_path, monkeypatch):
    for name in CREDENTIAL_ENV:  # recorded as they were, then cleared: ensure_run_token sets one itself
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    made = auth.ensure_run_token(tmp_path / "runs")  # no token given: the output directory's, made on first use
    path = tmp_path / "runs" / ".credentials" / "token"
    assert os.environ[auth.TOKEN_FILE_ENV] == str(path) and auth.read_token_file(path) == made and len(made) >= 32
    assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
    monkeypatch.delenv(auth.TOKEN_FILE_ENV)  # another command (a rerun, `recurring fire`) on the same directory
    assert auth.ensure_run_token(tmp_path / "runs") == made
    assert not [p for p in path.parent.iterdir() if p != path]  # no temporary file left beside it
    monkeypatch.delenv(auth.TOKEN_FILE_ENV)
    monkeypatch.setenv(auth.TOKEN_ENV, "given")  # a token given wins, and no file is made for it
    assert auth.ensure_run_token(tmp_path / "elsewhere") == "given" and not (tmp_path / "elsewhere").exists()
    monkeypatch.delenv(auth.TOKEN_ENV)
    path.chmod(0o640)
    with pytest.raises(auth.CredentialError, match="chmod 600"):
        auth.ensure_run_token(tmp_path / "runs")
    monkeypatch.setenv(auth.AUTH_ENV, "off")
    assert auth.ensure_run_token(tmp_path / "off") is None and not (tmp_path / "off").exists()


@pytest.mark.parametrize("header, token, expected", [
    ("Bearer tok-123", "tok-123", True),
    ("bearer tok-123", "tok-123", True),
    ("BEARER tok-123", "tok-123", True),
    ("Bearer  tok-123 ", "tok-123", True),
    ("Bearer tok-124", "tok-123", False),
    ("Bearer tok-12", "tok-123", False),
    ("Bearer tok-1234", "tok-123", False),
    ("Bearer TOK-123", "tok-123", False),
    ("Basic tok-123", "tok-123", False),
    ("Token tok-123", "tok-123", False),
    ("tok-123", "tok-123", False),
    ("Bearer", "tok-123", False),
    ("Bearer ", "tok-123", False),
    ("", "tok-123", False),
    (None, "tok-123", False),
    ("Bearer tök-123", "tok-123", False),
    ("Bearer tok-123,Bearer other", "tok-123", False),
    (None, None, True),  # no credential demanded (AREAL_PIPELINE_AUTH=off)
    ("Basic anything", None, True),
])
def test_authorized(header, token, expected):
    assert auth.authorized(header, token) is expected


# ----- (5) the token is in no log and on no command line -----------------------------------------------------

def test_the_token_is_in_no_log_and_on_no_command_line(cpu_server, retrieval, trainer, work, tmp_path_factory):
    process, _ = trainer
    logs = [cpu_server_log(tmp_path_factory, cpu_server), retrieval.log_path, process.log_path,
            *work.glob("*.log"), *(work / "trainer").rglob("*.log")]
    assert all(log.is_file() for log in logs) and len(logs) >= 3, logs
    refused = [header.split(" ", 1)[-1] for header in wrong_credentials(TOKEN).values() if header]
    for log in set(logs):
        text = log.read_text(errors="replace")
        assert TOKEN not in text, log
        assert not any(len(wrong) >= 16 and wrong in text for wrong in refused), log

    started = psutil.Process().children(recursive=True)
    pids = {p.pid for p in started}
    assert retrieval.popen.pid in pids and process.popen.pid in pids, (pids, retrieval.popen.pid, process.popen.pid)
    assert any(f"--port {cpu_server.rsplit(':', 1)[1]}" in " ".join(p.cmdline()) for p in started
               if p.is_running())
    for child in started:
        try:
            cmdline = Path(f"/proc/{child.pid}/cmdline").read_bytes()
        except (FileNotFoundError, ProcessLookupError):  # ended since
            continue
        assert TOKEN.encode() not in cmdline, cmdline


# ----- SGLang's own check, from its wheels: the header the clients send passes it where the project needs it to ---
@pytest.mark.parametrize("version", ["0.5.10.post1", "0.5.23"])
def test_sglang_s_own_key_check_takes_the_clients_header_on_every_route_the_pipeline_calls(version, monkeypatch):
    """SGLang is launched with the run's token as its --api-key (areal_pipeline/with_token.py); its middleware's
    decision, run as SGLang wrote it, admits what the project's clients send on the routes they call (the weight
    routes are SGLang's admin-optional ones: the api key opens them while no admin key is set), and refuses
    what a caller without the token sends. Its health probes are open, as the project's /health is."""
    import dataclasses
    import enum
    import secrets
    import typing

    from _sglang_reference import definitions, source

    found = definitions(source(version, "sglang/srt/utils/auth.py"), ["AuthLevel", "decide_request_auth"],
                        {"dataclass": dataclasses.dataclass, "Enum": enum.Enum, "Optional": typing.Optional,
                         "Any": typing.Any, "secrets": secrets})
    level, decide = found["AuthLevel"], found["decide_request_auth"]
    monkeypatch.delenv(auth.TOKEN_FILE_ENV, raising=False)
    monkeypatch.setenv(auth.TOKEN_ENV, "the-run-token")
    sent = auth.auth_headers()["Authorization"]

    def allowed(path: str, header, route_level) -> bool:
        return decide(method="POST", path=path, authorization_header=header, api_key="the-run-token",
                      admin_api_key=None, auth_level=route_level).allowed

    routes = [("/generate", level.NORMAL), ("/model_info", level.NORMAL), ("/pause_generation", level.NORMAL),
              ("/v1/chat/completions", level.NORMAL), ("/update_weights_from_disk", level.ADMIN_OPTIONAL),
              ("/init_weights_update_group", level.ADMIN_OPTIONAL), ("/flush_cache", level.ADMIN_OPTIONAL),
              ("/update_weights_from_distributed", level.ADMIN_OPTIONAL)]
    for path, route_level in routes:
        assert allowed(path, sent, route_level), (version, path)
        for header in (None, "", "Bearer the-run-tokeN", "Basic the-run-token", "the-run-token"):
            assert not allowed(path, header, route_level), (version, path, header)
    assert allowed("/health", None, level.NORMAL) and allowed("/health_generate", None, level.NORMAL)

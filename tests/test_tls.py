"""TLS where a user asks for it (areal_pipeline/auth.py): the services serve HTTPS with a certificate and key, the
clients check them against a CA bundle. The certificates are made here (trustme): a CA, and a certificate it
signed for 127.0.0.1. The run across four hosts with TLS on is tests/test_multi_host.py."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import ssl
import sys
import urllib.error
import urllib.request

import pytest
import trustme

from areal_pipeline import auth
from areal_pipeline.inference.client import InferenceServerError, RemoteSGLangEngine
from areal_pipeline.inference.types import ModelRequest, SamplingParams
from areal_pipeline.processes import ServerProcess
from areal_pipeline.training.rank_control import Endpoint
from areal_pipeline.utils import environment, find_free_port


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tls")
    ca = trustme.CA()
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(folder / "server.pem"))
    ca.cert_pem.write_to_path(str(folder / "ca.pem"))
    trustme.CA().cert_pem.write_to_path(str(folder / "other-ca.pem"))  # a CA that signed nothing of ours
    return folder


@pytest.fixture
def tls_on(tls_files, monkeypatch):
    monkeypatch.setenv(auth.TLS_CERT_ENV, str(tls_files / "server.pem"))
    monkeypatch.setenv(auth.TLS_KEY_ENV, str(tls_files / "server.pem"))
    monkeypatch.setenv(auth.TLS_CA_ENV, str(tls_files / "ca.pem"))
    return tls_files


@pytest.fixture(scope="module")
def https_server(tiny_model_dir, tls_files, tmp_path_factory):
    port = find_free_port()
    env = {**os.environ, auth.TLS_CERT_ENV: str(tls_files / "server.pem"),
           auth.TLS_KEY_ENV: str(tls_files / "server.pem")}
    server = ServerProcess([sys.executable, "-m", "areal_pipeline.inference.server", "--model", str(tiny_model_dir),
                            "--host", "127.0.0.1", "--port", str(port), "--enable-deterministic-inference"],
                           f"127.0.0.1:{port}", tmp_path_factory.mktemp("logs") / "server.log", env=env).start()
    try:
        with environment(**{auth.TLS_CA_ENV: str(tls_files / "ca.pem")}):
            server.wait_healthy(120)  # the health probe speaks HTTPS too
        yield server
    finally:
        server.stop()


def test_the_project_s_client_generates_over_https_and_checks_the_certificate(https_server, tls_on, monkeypatch):
    assert https_server.is_healthy()
    assert auth.url(https_server.address, "/x") == f"https://{https_server.address}/x"

    async def generate() -> list[int]:
        engine = RemoteSGLangEngine([https_server.address], request_retries=0)
        try:
            reply = await engine.agenerate(ModelRequest(input_ids=[1, 2, 3], sampling=SamplingParams(
                max_new_tokens=3, temperature=0.0, ignore_eos=True)))
            return reply.output_tokens
        finally:
            await engine.close()

    assert len(asyncio.run(generate())) == 3
    monkeypatch.setenv(auth.TLS_CA_ENV, str(tls_on / "other-ca.pem"))  # a certificate the client cannot trust
    with pytest.raises(InferenceServerError, match="certificate verify failed"):
        asyncio.run(generate())
    assert not https_server.is_healthy()


def test_plain_http_to_an_https_service_gets_no_answer(https_server, monkeypatch):
    monkeypatch.delenv(auth.TLS_CA_ENV, raising=False)
    monkeypatch.delenv(auth.TLS_CERT_ENV, raising=False)
    assert auth.scheme() == "http" and not https_server.is_healthy()


def test_the_trainer_endpoint_serves_https_and_a_silent_client_holds_up_no_one(tls_on):
    class Trainer:
        def status(self) -> dict:
            return {"version": 7}

    endpoint = Endpoint("127.0.0.1", 0, Trainer(), auth.run_token(), auth.server_ssl_context())
    endpoint.start()
    try:
        address = f"127.0.0.1:{endpoint.server.server_address[1]}"
        silent = socket.create_connection(("127.0.0.1", endpoint.server.server_address[1]))  # never handshakes
        with auth.opener().open(auth.request(address, "/health"), timeout=10) as reply:
            assert json.loads(reply.read())["version"] == 7
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
            plain = ssl.create_default_context()  # the system's CAs: the test's CA is not among them
            urllib.request.build_opener(urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(
                context=plain)).open(f"https://{address}/health", timeout=10)
        silent.close()
    finally:
        endpoint.stop()


def test_a_certificate_without_its_key_or_a_missing_file_is_a_clear_error(tls_files, monkeypatch):
    monkeypatch.setenv(auth.TLS_CERT_ENV, str(tls_files / "server.pem"))
    monkeypatch.delenv(auth.TLS_KEY_ENV, raising=False)
    with pytest.raises(auth.CredentialError, match="needs both AREAL_PIPELINE_TLS_CERT and AREAL_PIPELINE_TLS_KEY"):
        auth.server_ssl_context()
    monkeypatch.setenv(auth.TLS_KEY_ENV, str(tls_files / "ca.pem"))  # a certificate where the key should be
    with pytest.raises(auth.CredentialError, match="cannot use them"):
        auth.server_ssl_context()
    monkeypatch.setenv(auth.TLS_CA_ENV, str(tls_files / "no-such.pem"))
    with pytest.raises(auth.CredentialError, match="no-such.pem: no such file"):
        auth.client_ssl_context()


def test_sglang_and_vllm_are_launched_with_the_same_certificate(tls_on):
    from areal_pipeline.config import SGLangConfig, VLLMConfig
    from areal_pipeline.inference.launcher import build_sglang_command, build_vllm_command

    for command in (build_sglang_command("/m", "127.0.0.1", 1, SGLangConfig(), 0),
                    build_vllm_command("/m", "127.0.0.1", 1, VLLMConfig(), 0)):
        assert command[command.index("--ssl-certfile") + 1] == str(tls_on / "server.pem")
        assert command[command.index("--ssl-keyfile") + 1] == str(tls_on / "server.pem")

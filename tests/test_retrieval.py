"""The retrieval server: BM25 on HotpotQA and on the generated knowledge base, the HTTP API and its errors,
the on-disk index cache, the dense option, the launcher and the clients."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest
from aiohttp import web

from areal_pipeline.config import DatasetConfig

from areal_pipeline.data.datasets import load_records
from areal_pipeline.data.knowledge_base import knowledge_base
from areal_pipeline.processes import ServerProcess
from areal_pipeline.run_spec import load_config
from areal_pipeline.tools.retrieval_client import LocalRetrievalClient, RetrievalClient, RetrievalError
from areal_pipeline.tools.retrieval_server import (
    BadRequest,
    RetrievalService,
    build_retriever,
    launch_retrieval_server,
    load_corpus,
)
from areal_pipeline.utils import find_free_port
from _http_helpers import serve_on_loopback
from conftest import TEST_DATA, data_dirs, http
from test_server import post_raw, while_polling_health

HOTPOTQA = TEST_DATA / "hotpotqa"  # the bundled slice: 30 questions, their 300 paragraphs


def _service(corpus: str | None, index_dir: Path, **kw) -> RetrievalService:
    rows, digest = load_corpus(corpus)
    return RetrievalService(rows, build_retriever(rows, digest, "bm25", index_dir), **kw)


@pytest.fixture(scope="module")
def kb_service(tmp_path_factory) -> RetrievalService:
    return _service(None, tmp_path_factory.mktemp("indexes"))


@pytest.mark.parametrize("hotpotqa_dir", data_dirs("hotpotqa"))
def test_bm25_finds_hotpotqa_supporting_paragraphs(tmp_path, hotpotqa_dir):
    service = _service(str(hotpotqa_dir / "corpus.jsonl"), tmp_path, max_queries=10_000)
    qa = [json.loads(line) for line in (hotpotqa_dir / "qa.jsonl").open()]
    results = service.retrieve({"queries": [q["question"] for q in qa], "topk": 10})["result"]
    titles = [{doc["title"] for doc in found} for found in results]
    # a question with one / both supporting paragraphs in the top 10; random picks would find one for ~7% of the
    # slice's questions (10 of 300 paragraphs, 2 of them right) and for ~0.2% in the full corpus
    one, both = (0.95, 0.8) if hotpotqa_dir.parent == TEST_DATA else (0.95, 0.6)
    assert sum(bool(set(q["supporting_titles"]) & t) for q, t in zip(qa, titles)) / len(qa) >= one
    assert sum(set(q["supporting_titles"]) <= t for q, t in zip(qa, titles)) / len(qa) >= both
    first = results[0][0]
    assert set(first) == {"id", "title", "contents"} and first["contents"].startswith(f'"{first["title"]}"\n')


def test_generated_knowledge_base_answers_every_question_in_one_or_two_searches(kb_service):
    kb = knowledge_base()
    by_title = {row["title"]: row for row in kb.corpus}
    assert len(by_title) == len(kb.corpus)  # titles (invented names) are unique
    questions = kb.questions["train"] + kb.questions["test"]
    assert {q["hops"] for q in questions} == {1, 2}
    for q in questions:
        entity = max((title for title in by_title if title in q["question"]), key=len)
        top = kb_service.retrieve({"queries": [entity], "topk": 1})["result"][0][0]
        assert top["title"] == entity, q
        if q["hops"] == 1:
            assert q["answer"][0] in top["contents"]
        else:  # the page names a city, whose page holds the answer
            city = top["contents"].split(" born in ")[1].split(" in ")[0]
            second = kb_service.retrieve({"queries": [city], "topk": 1})["result"][0][0]
            assert second["title"] == city and q["answer"][0] in second["contents"]


def test_generated_questions_are_the_search_qa_dataset():
    train = load_records(DatasetConfig(name="search_qa"), "train", seed=1)
    test = load_records(DatasetConfig(name="search_qa"), "test", seed=2)
    assert [r["question"] for r in train] == [q["question"] for q in knowledge_base().questions["train"]]
    assert not {r["question"] for r in train} & {r["question"] for r in test}
    assert train[0]["messages"] == [{"role": "user", "content": train[0]["question"]}]
    assert isinstance(train[0]["answer"], list) and len({r["prompt_id"] for r in train}) == len(train)


def test_results_hold_only_documents_sharing_a_term(kb_service):
    result = kb_service.retrieve({"queries": ["", "zzqx unknownword", "the of a"], "topk": 5})["result"]
    assert result == [[], [], []]
    scored = kb_service.retrieve({"queries": ["capital"], "topk": 3, "return_scores": True})["result"][0]
    assert len(scored) == 3 and all(set(hit) == {"document", "score"} and hit["score"] > 0 for hit in scored)
    assert [h["score"] for h in scored] == sorted((h["score"] for h in scored), reverse=True)


@pytest.mark.parametrize("body, message", [
    ([], "must be a JSON object"),
    ({"queries": "capital"}, "'queries' must be a list of strings"),
    ({"queries": [1]}, "'queries' must be a list of strings"),
    ({"queries": ["x"], "topk": 0}, "'topk' must be an integer in [1, 5]"),
    ({"queries": ["x"], "topk": 6}, "'topk' must be an integer in [1, 5]"),
    ({"queries": ["x"], "topk": True}, "'topk' must be an integer"),
    ({"queries": ["x" * 21]}, "query 0 has 21 characters; the limit is 20"),
    ({"queries": ["x"], "return_scores": "yes"}, "'return_scores' must be true or false"),
    ({"queries": ["x"], "top_k": 3}, "unknown field(s) ['top_k']"),
    ({"queries": ["x"] * 7}, "7 queries in one request; the limit is 6"),
])
def test_bad_requests_are_rejected(kb_service, body, message):
    strict = RetrievalService(kb_service.rows, kb_service.retriever, topk=2, max_topk=5, max_query_chars=20,
                              max_queries=6)
    with pytest.raises(BadRequest) as err:
        strict.retrieve(body)
    assert message in str(err.value)
    assert err.value.status == (413 if "queries in one request" in message else 400)


def test_index_is_built_once_and_keyed_by_corpus_content(tmp_path, monkeypatch):
    import bm25s

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": str(i), "title": f"t{i}", "contents": f"doc number {i} about {w}"}) + "\n"
                              for i, w in enumerate(["apples", "pears", "plums"])))
    service = _service(str(corpus), tmp_path / "idx")
    assert [d["id"] for d in service.retrieve({"queries": ["pears"]})["result"][0]] == ["1"]
    (built,) = list((tmp_path / "idx").iterdir())
    monkeypatch.setattr(bm25s.BM25, "index", lambda *a, **k: pytest.fail("the index was rebuilt"))
    _service(str(corpus), tmp_path / "idx")  # loads the cached index
    monkeypatch.undo()
    corpus.write_text(corpus.read_text().replace("plums", "cherries"))
    service = _service(str(corpus), tmp_path / "idx")
    assert len(list((tmp_path / "idx").iterdir())) == 2 and built.exists()
    assert [d["id"] for d in service.retrieve({"queries": ["cherries"]})["result"][0]] == ["2"]


def test_corpus_errors_name_the_file_and_line(tmp_path):
    with pytest.raises(FileNotFoundError, match="retrieval corpus not found"):
        load_corpus(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "0", "title": "a", "contents": "x"}\n{"id": "1", "title": "b"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl, line 2: expected an object with a string 'contents'"):
        load_corpus(str(bad))
    with pytest.raises(ValueError, match="unknown retriever 'tfidf'; valid: bm25, dense"):
        build_retriever([{"contents": "x"}], "0" * 64, "tfidf", tmp_path)
    with pytest.raises(ValueError, match="needs an embedding model directory"):
        build_retriever([{"contents": "x"}], "0" * 64, "dense", tmp_path)


def test_dense_retriever_with_a_local_encoder(tmp_path):
    from transformers import BertConfig, BertModel

    from areal_pipeline.model import build_byte_tokenizer

    tokenizer = build_byte_tokenizer()
    encoder = tmp_path / "encoder"
    BertModel(BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=512)).save_pretrained(encoder)
    tokenizer.save_pretrained(encoder)
    rows = knowledge_base().corpus[:40]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(None, [f"rollout.agent.retrieval.corpus={corpus}", "rollout.agent.retrieval.retriever=dense",
                             f"rollout.agent.retrieval.embedding_model={encoder}",
                             f"rollout.agent.retrieval.index_dir={tmp_path / 'idx'}"])
    service = RetrievalService.from_config(cfg.rollout.agent.retrieval, tmp_path / "unused")
    hits = service.retrieve({"queries": [rows[7]["contents"]], "topk": 3, "return_scores": True})["result"][0]
    assert hits[0]["document"] == rows[7] and hits[0]["score"] == pytest.approx(1.0, abs=1e-5)
    assert len(hits) == 3 and service.retriever.name == "dense"
    (index_dir,) = list((tmp_path / "idx").iterdir())
    assert index_dir.name.startswith("dense-") and (index_dir / "embeddings.npy").is_file()
    assert not (tmp_path / "unused").exists()
    # the embeddings are cached: a second service reads them instead of encoding the corpus again
    mtime = (index_dir / "embeddings.npy").stat().st_mtime_ns
    RetrievalService.from_config(cfg.rollout.agent.retrieval, tmp_path / "unused")
    assert (index_dir / "embeddings.npy").stat().st_mtime_ns == mtime


@pytest.fixture(scope="module")
def hotpotqa_server(tmp_path_factory):
    port = find_free_port()
    logs = tmp_path_factory.mktemp("retrieval-logs")
    command = [sys.executable, "-m", "cli", "retrieval-server", "--corpus", str(HOTPOTQA / "corpus.jsonl"),
               "--host", "127.0.0.1", "--port", str(port), "--index-dir", str(logs / "idx"), "--max-topk", "20"]
    server = ServerProcess(command, f"127.0.0.1:{port}", logs / "server.log").start()
    server.wait_healthy(120)
    yield server.address
    server.stop()


def test_http_api_on_hotpotqa(hotpotqa_server):
    status, body = http(hotpotqa_server, "/health")
    num_docs = sum(1 for line in (HOTPOTQA / "corpus.jsonl").open() if line.strip())
    assert status == 200 and body == {"status": "ok", "retriever": "bm25", "num_docs": num_docs} and num_docs == 300
    status, body = http(hotpotqa_server, "/retrieve", {"queries": ["Socialist Revolutionary Party Kerensky", "Poleconomy"],
                                                       "topk": 2})
    assert status == 200 and len(body["result"]) == 2
    assert body["result"][0][0]["title"] == "Socialist Revolutionary Party"
    assert body["result"][1][0]["title"] == "Poleconomy"
    status, body = http(hotpotqa_server, "/retrieve", {"queries": ["board game politics economy"], "return_scores": True})
    assert status == 200 and len(body["result"][0]) == 3  # the server's default topk
    assert body["result"][0][0]["document"]["title"] == "Poleconomy" and body["result"][0][0]["score"] > 0


def test_http_errors(hotpotqa_server):
    status, body = http(hotpotqa_server, "/retrieve", {"queries": ["x"], "topk": 21})
    assert status == 400 and body == {"error": {"message": "'topk' must be an integer in [1, 20], got 21"}}
    status, body = http(hotpotqa_server, "/retrieve", {"queries": ["x" * 2001]})
    assert status == 400 and "the limit is 2000" in body["error"]["message"]
    import urllib.error

    from areal_pipeline import auth

    req = auth.request(hotpotqa_server, "/retrieve", data=b"{not json", method="POST",
                       headers={"Content-Type": "application/json"})
    try:
        auth.opener().open(req, timeout=10)
        pytest.fail("invalid JSON was accepted")
    except urllib.error.HTTPError as e:
        assert e.code == 415 and "not valid JSON" in json.loads(e.read())["error"]["message"]
    assert http(hotpotqa_server, "/search", {"queries": ["x"]})[0] == 404


def test_http_client_against_the_server(hotpotqa_server):
    docs = asyncio.run(RetrievalClient(hotpotqa_server).retrieve(["Poleconomy", ""], topk=1))
    assert docs[0][0]["title"] == "Poleconomy" and docs[1] == []
    with pytest.raises(RetrievalError, match="HTTP 400: 'topk' must be an integer"):
        asyncio.run(RetrievalClient(hotpotqa_server).retrieve(["x"], topk=99))


def test_launcher_serves_the_generated_knowledge_base(tmp_path):
    cfg = load_config("configs/search_agent.yaml", [f"output_dir={tmp_path}"])
    server = launch_retrieval_server(cfg, tmp_path / "logs")
    try:
        status, body = http(server.address, "/health")
        assert status == 200 and body["num_docs"] == len(knowledge_base().corpus)
        person = knowledge_base().corpus[-1]
        status, body = http(server.address, "/retrieve", {"queries": [person["title"]], "topk": 1})
        assert body["result"] == [[person]]
        assert (tmp_path / "logs" / "retrieval-server.log").is_file()
        assert len(list((tmp_path / "_indexes").glob("bm25-*"))) == 1
    finally:
        server.stop()


@pytest.fixture(scope="module")
def kb_server(tmp_path_factory):
    """`areal-pipeline retrieval-server` over the generated knowledge base, started as a user would: no
    --index-dir, in a directory of its own, with the default request limits."""
    home = tmp_path_factory.mktemp("retrieval-user")
    port = find_free_port()
    command = ["/bin/sh", "-c", 'cd "$0" && exec "$@"', str(home / "cwd"), sys.executable, "-m", "cli",
               "retrieval-server", "--host", "127.0.0.1", "--port", str(port)]
    (home / "cwd").mkdir()
    server = ServerProcess(command, f"127.0.0.1:{port}", home / "server.log",
                           env={**os.environ, "XDG_CACHE_HOME": str(home / "cache")})
    server.start()
    server.wait_healthy(120)
    yield server.address, home
    server.stop()


def test_a_server_of_its_own_keeps_its_index_in_the_user_cache(kb_server):
    _, home = kb_server
    assert len(list((home / "cache" / "areal-pipeline" / "indexes").glob("bm25-*"))) == 1
    assert list((home / "cwd").iterdir()) == []  # it used to write runs/_indexes under the current directory


def test_oversized_requests_are_413_at_once_while_health_answers(kb_server):
    """50,000 queries in one request took 126 s and 5.3 GB while every other client waited."""
    address, _ = kb_server
    many = json.dumps({"queries": ["capital"] * 50_000, "topk": 3}).encode()
    big = json.dumps({"queries": ["capital of " * 200_000]}).encode()
    for data, fragment in [(many, "50000 queries in one request; the limit is 256"),
                           (big, f"the request body has {len(big)} bytes; the limit is 1048576")]:
        (status, reply), took, latencies = while_polling_health(
            address, lambda: post_raw(address, "/retrieve", data, "application/json"))
        assert status == 413 and fragment in reply["error"]["message"], reply
        # refused at once, health answering meanwhile: half the minutes it took, the bound a loaded machine meets
        assert took < 60 and latencies and max(latencies) < 20, (took, latencies)
    # the largest request taken holds the search worker for moments, not minutes
    largest = {"queries": [" ".join(["capital", "born", "river"] * 300)[:2000]] * 256, "topk": 50}
    (status, reply), took, latencies = while_polling_health(address, lambda: http(address, "/retrieve", largest))
    assert status == 200 and len(reply["result"]) == 256 and took < 60, took
    assert max(latencies) < 20, latencies


@pytest.mark.parametrize("body, message", [
    ({"queries": [["capital"]]}, "'queries' must be a list of strings, got [['capital']]"),
    ({"queries": None}, "'queries' must be a list of strings, got None"),
    ({"queries": {"q": "capital"}}, "'queries' must be a list of strings"),
    ({"queries": ["x"], "topk": "3"}, "'topk' must be an integer in [1, 50], got '3'"),
    ({"queries": ["x"], "topk": 1.5}, "'topk' must be an integer in [1, 50], got 1.5"),
    ({"queries": ["x"], "topk": float("nan")}, "'topk' must be an integer in [1, 50], got nan"),
    ({"queries": ["x"], "return_scores": {"yes": True}}, "'return_scores' must be true or false"),
    (["capital"], "the request body must be a JSON object"),
])
def test_http_wrong_typed_fields_are_400(kb_server, body, message):
    status, reply = http(kb_server[0], "/retrieve", body)
    assert status == 400 and message in reply["error"]["message"], reply


@pytest.mark.parametrize("data, content_type, status, fragment", [
    (b'{"queries": ["capital"]}', None, 415, "must be JSON (Content-Type: application/json)"),
    (b'{"queries": ["capital"]}', "text/plain", 415, "not 'text/plain'"),
    (b'{"queries": ["capital"]', "application/json", 415, "not valid JSON"),
    (b"[" * 50_000 + b"]" * 50_000, "application/json", 400, "nested too deeply"),
    (b'{"queries": ["capital"]}', "application/json", 200, ""),
])
def test_http_a_body_that_is_not_json_is_415(kb_server, data, content_type, status, fragment):
    got, reply = post_raw(kb_server[0], "/retrieve", data, content_type)
    assert got == status and (status == 200 or fragment in reply["error"]["message"]), reply


def test_launcher_passes_the_request_limits(tmp_path):
    cfg = load_config("configs/search_agent.yaml", [f"output_dir={tmp_path}", "rollout.agent.retrieval.max_queries=2",
                                                    "rollout.agent.retrieval.max_body_bytes=200"])
    server = launch_retrieval_server(cfg, tmp_path / "logs")
    try:
        status, reply = http(server.address, "/retrieve", {"queries": ["a", "b", "c"]})
        assert status == 413 and "3 queries in one request; the limit is 2" in reply["error"]["message"]
        status, reply = http(server.address, "/retrieve", {"queries": ["a" * 300]})
        assert status == 413 and "the limit is 200" in reply["error"]["message"]
        assert http(server.address, "/retrieve", {"queries": ["a", "b"]})[0] == 200
    finally:
        server.stop()


async def _flaky_server(failures: int, status: int, calls: list):
    async def retrieve(request):
        calls.append(await request.json())
        if len(calls) <= failures:
            return web.json_response({"error": {"message": "busy"}}, status=status)
        return web.json_response({"result": [[{"id": "1", "title": "t", "contents": "c"}]]})

    runner, address = await serve_on_loopback("/retrieve", retrieve)
    return runner, address


def test_client_retries_server_errors_but_not_bad_requests():
    async def go(failures, status, retries):
        calls: list = []
        runner, address = await _flaky_server(failures, status, calls)
        try:
            return await RetrievalClient(address, retries=retries, retry_delay=0.01).retrieve(["q"], 2), calls
        except RetrievalError as e:
            return e, calls
        finally:
            await runner.cleanup()

    result, calls = asyncio.run(go(2, 500, retries=2))
    assert result == [[{"id": "1", "title": "t", "contents": "c"}]] and len(calls) == 3
    assert calls[0] == {"queries": ["q"], "topk": 2, "return_scores": False}
    result, calls = asyncio.run(go(2, 500, retries=1))
    assert isinstance(result, RetrievalError) and "HTTP 500: busy" in str(result) and len(calls) == 2
    result, calls = asyncio.run(go(5, 400, retries=3))
    assert isinstance(result, RetrievalError) and "HTTP 400: busy" in str(result) and len(calls) == 1


def test_client_reports_an_unreachable_server(dead_address):
    address = dead_address
    with pytest.raises(RetrievalError, match=f"retrieval server {address}: ClientConnectorError"):
        asyncio.run(RetrievalClient(address, retries=1, retry_delay=0.01).retrieve(["q"], 1))


def test_in_process_client(kb_service):
    client = LocalRetrievalClient(kb_service)
    person = knowledge_base().corpus[-1]
    assert asyncio.run(client.retrieve([person["title"]], 1)) == [[person]]
    with pytest.raises(RetrievalError, match="in-process retrieval: 'topk' must be an integer"):
        asyncio.run(client.retrieve(["x"], 0))

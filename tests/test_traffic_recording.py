"""The CPU server's traffic recording (issue #51, serving side): real server subprocesses with --record-dir, driven
through the real `openai` SDK, then read back with areal_pipeline/online/traffic_log.py: each choice recorded token
for token, the weight version of each token across a weight update, feedback, kill -9, rotation, retention, and a
shard whose bytes were altered."""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import math
import os
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import openai
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from areal_pipeline import auth
from areal_pipeline.inference.openai_requests import parse_messages
from areal_pipeline.inference.openai_tools import chat_prompt_ids
from areal_pipeline.model import load_tokenizer
from areal_pipeline.online.traffic_log import (FEEDBACK_FIELDS, REQUEST_FIELDS, ShardError, TrafficLog,
                                               canonical_json, prompt_sha256, read_records, read_shard,
                                               record_sha256, recover_journals, remove_older_than)
from conftest import http, start_cpu_server

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]
DAY = 86400.0


def client(address: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://{address}/v1", api_key=auth.run_token() or "none", max_retries=0)


def run(coroutine):
    return asyncio.run(coroutine)


def files(directory: Path, kind: str, suffix: str) -> list[Path]:
    folder = directory / kind
    return sorted(p for p in folder.glob(f"*{suffix}") if not p.name.startswith(".")) if folder.is_dir() else []


def sample_counts(directory: Path) -> collections.Counter:
    """How often each sample id is on disk, journals (valid complete lines) and shards together, not deduplicated."""
    counts = collections.Counter()
    for journal in files(directory, "requests", ".jsonl"):
        for line in journal.read_bytes().split(b"\n")[:-1]:
            entry = json.loads(line)
            if record_sha256(entry["record"]) == entry["sha256"]:
                counts[entry["record"]["sample_id"]] += 1
    for shard in files(directory, "requests", ".parquet"):
        counts.update(r["sample_id"] for r in read_shard(shard, "requests"))
    return counts


def a_request(name: str, created_at: float) -> dict:
    """A request record as a server writes one (a chat completion's one choice)."""
    record = dict.fromkeys(REQUEST_FIELDS, "")
    record.update(sample_id=f"{name}/0", response_id=name, choice=0, conversation_id=name, created_at=created_at,
                  version=0, prompt_ids=[1, 2, 3], completion_ids=[4, 5], logprobs=[-0.5, -1.25], versions=[0, 0],
                  temperature=1.0, top_p=1.0, max_tokens=-1, prompt_sha256=prompt_sha256([1, 2, 3]))
    return record


def a_feedback(name: str, received_at: float) -> dict:
    record = dict.fromkeys(FEEDBACK_FIELDS, "")
    record.update(feedback_id=name, response_id="chatcmpl-x", reward=1.0, received_at=received_at)
    return record


def journal_line(record: dict) -> bytes:
    return json.dumps({"sha256": record_sha256(record), "record": record}).encode() + b"\n"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def recording(tiny_model_dir, tmp_path_factory):
    """A server recording into its own folder, sealing journals older than 2 s."""
    root = tmp_path_factory.mktemp("recording")
    server = start_cpu_server(tiny_model_dir, root, "--record-dir", str(root / "traffic"), "--record-rotate-s", "2")
    yield SimpleNamespace(address=server.address, dir=root / "traffic")
    server.stop()


def test_each_choice_is_recorded_token_for_token(recording, tokenizer):
    version = int(http(recording.address, "/get_model_info")[1]["weight_version"])

    async def go():
        async with client(recording.address) as c:
            tagged = await c.chat.completions.create(model="m", messages=MESSAGES, n=2, max_tokens=8, logprobs=True,
                                                     seed=5, metadata={"conversation_id": "c1"}, user="someone",
                                                     store=False)
            headed = await c.chat.completions.create(model="m", messages=MESSAGES, max_tokens=6, logprobs=True,
                                                     extra_headers={"X-Conversation-Id": "c2"})
            bare = await c.chat.completions.create(model="m", messages=MESSAGES[1:], max_tokens=4, temperature=0.5,
                                                   top_p=0.9)
            return tagged, headed, bare

    tagged, headed, bare = run(go())
    records, problems = read_records(recording.dir, "requests")
    assert problems == []
    recorded = {r["sample_id"]: r for r in records}
    prompt = chat_prompt_ids(tokenizer, parse_messages(MESSAGES))
    for reply, conversation, messages in ((tagged, "c1", MESSAGES), (headed, "c2", MESSAGES),
                                          (bare, bare.id, MESSAGES[1:])):
        assert reply.id.startswith("chatcmpl-")
        for choice in reply.choices:
            r = recorded[f"{reply.id}/{choice.index}"]
            assert (r["response_id"], r["choice"], r["conversation_id"]) == (reply.id, choice.index, conversation)
            assert (r["server"], r["model"], r["finish_reason"]) == (recording.address, "m", choice.finish_reason)
            assert r["prompt_ids"] == chat_prompt_ids(tokenizer, parse_messages(messages))
            assert r["prompt_sha256"] == prompt_sha256(r["prompt_ids"])
            assert tokenizer.decode(r["completion_ids"], skip_special_tokens=True) == choice.message.content
            assert len(r["completion_ids"]) == len(r["logprobs"]) == len(r["versions"]) > 0
            if choice.logprobs is not None:  # exactly the SDK's numbers, not within a tolerance
                assert r["logprobs"] == [t.logprob for t in choice.logprobs.content]
            assert r["versions"] == [version] * len(r["completion_ids"]) and r["version"] == version
            assert json.loads(r["reply"]) == {"role": "assistant", "content": choice.message.content}
            assert json.loads(r["messages"]) == messages and r["tools"] == ""
            assert abs(r["created_at"] - time.time()) < 120
    assert [recorded[f"{tagged.id}/{i}"]["prompt_ids"] for i in (0, 1)] == [prompt, prompt]
    assert tagged.choices[0].message.content != tagged.choices[1].message.content
    assert sum(len(recorded[f"{tagged.id}/{i}"]["completion_ids"]) for i in (0, 1)) == tagged.usage.completion_tokens
    by_reply = {r["response_id"]: r for r in records}
    assert (by_reply[tagged.id]["temperature"], by_reply[tagged.id]["top_p"], by_reply[tagged.id]["max_tokens"]) \
        == (1.0, 1.0, 8)
    assert (by_reply[bare.id]["temperature"], by_reply[bare.id]["top_p"], by_reply[bare.id]["max_tokens"]) \
        == (0.5, 0.9, 4)
    assert by_reply[bare.id]["prompt_sha256"] != by_reply[tagged.id]["prompt_sha256"]


def generated_tokens(address: str) -> int:
    return http(address, "/get_server_info")[1]["internal_states"][0]["generated_tokens"]


async def a_long_generation_underway(c, address: str, seed: int) -> asyncio.Task:
    """A 700-token chat completion, returned once the server has generated 20 tokens of it."""
    before = await asyncio.to_thread(generated_tokens, address)
    long = asyncio.create_task(c.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=700, seed=seed, extra_body={"ignore_eos": True}))
    deadline = time.monotonic() + 60
    while await asyncio.to_thread(generated_tokens, address) < before + 20:
        assert time.monotonic() < deadline and not long.done(), "the generation never started"
        await asyncio.sleep(0.01)
    return long


def test_each_token_keeps_the_version_that_made_it_across_a_weight_update(recording, tiny_model_dir):
    """A generation that a pause for a weight update interrupts is resent by the route: its tokens before the
    pause carry the old version, those after it the new one; requests after it are recorded with the new one."""
    address = recording.address
    old = int(http(address, "/get_model_info")[1]["weight_version"])

    async def go():
        async with client(address) as c:
            long = await a_long_generation_underway(c, address, seed=3)
            assert (await asyncio.to_thread(http, address, "/pause_generation", {}))[0] == 200
            await asyncio.sleep(0.2)
            assert not long.done()
            status, update = await asyncio.to_thread(http, address, "/update_weights_from_disk",
                                                     {"model_path": str(tiny_model_dir), "weight_version": "5"})
            assert status == 200 and update["success"], update
            assert (await asyncio.to_thread(http, address, "/continue_generation", {}))[0] == 200
            interrupted = await asyncio.wait_for(long, 120)
            after = await c.chat.completions.create(model="m", messages=MESSAGES, max_tokens=3)
            return interrupted, after

    interrupted, after = run(go())
    records, problems = read_records(recording.dir, "requests")
    assert problems == []
    recorded = {r["sample_id"]: r for r in records}
    spanning = recorded[f"{interrupted.id}/0"]
    versions = spanning["versions"]
    assert len(versions) == len(spanning["completion_ids"]) == interrupted.usage.completion_tokens == 700
    switch = versions.index(5)
    assert 20 <= switch < 700 and versions == [old] * switch + [5] * (700 - switch), versions
    assert spanning["version"] == 5
    assert recorded[f"{after.id}/0"]["versions"] == [5, 5, 5] and recorded[f"{after.id}/0"]["version"] == 5


def test_a_promotion_without_a_pause_labels_each_token_with_the_weights_that_sampled_it(recording, tiny_model_dir):
    """A line's promotion loads the champion between two decode steps without pausing (recurring/publish.py): a
    generation running across it has tokens of both versions in one completion, each labelled with its own."""
    address = recording.address

    async def go():
        async with client(address) as c:
            before = await asyncio.to_thread(generated_tokens, address)
            long = await a_long_generation_underway(c, address, seed=4)
            status, update = await asyncio.to_thread(http, address, "/update_weights_from_disk",
                                                     {"model_path": str(tiny_model_dir), "weight_version": "9"})
            assert status == 200 and update["success"], update
            spanning = await asyncio.wait_for(long, 120)
            assert await asyncio.to_thread(generated_tokens, address) > before + 20  # it went on after the load
            return spanning

    spanning = run(go())
    records, problems = read_records(recording.dir, "requests")
    assert problems == []
    versions = {r["sample_id"]: r for r in records}[f"{spanning.id}/0"]["versions"]
    assert len(versions) == 700 and versions[-1] == 9 and 9 in versions and versions[0] != 9, versions
    switch = versions.index(9)
    assert versions == [versions[0]] * switch + [9] * (700 - switch), versions


def test_feedback_is_recorded_and_a_bad_one_refused_naming_its_field(recording, cpu_server):
    address = recording.address
    status, by_response = http(address, "/v1/feedback", {"response_id": "chatcmpl-abc", "reward": 1,
                                                         "comment": "spot on"})
    assert status == 200 and by_response["object"] == "feedback" and by_response["id"].startswith("fb-")
    assert (by_response["response_id"], by_response["conversation_id"], by_response["reward"]) == \
        ("chatcmpl-abc", None, 1.0)
    status, by_conversation = http(address, "/v1/feedback", {"conversation_id": "c1", "reward": -0.5})
    assert status == 200 and by_conversation["conversation_id"] == "c1"
    records, problems = read_records(recording.dir, "feedback")
    assert problems == []
    recorded = {r["feedback_id"]: r for r in records}
    first, second = recorded[by_response["id"]], recorded[by_conversation["id"]]
    assert (first["response_id"], first["conversation_id"], first["reward"], first["comment"]) == \
        ("chatcmpl-abc", "", 1.0, "spot on")
    assert (second["response_id"], second["conversation_id"], second["reward"], second["comment"]) == \
        ("", "c1", -0.5, "")
    assert first["server"] == address and abs(first["received_at"] - time.time()) < 120

    refused = [
        ({"reward": 1}, "response_id"),
        ({"response_id": "a", "conversation_id": "b", "reward": 1}, "conversation_id"),
        ({"response_id": "", "reward": 1}, "response_id"),
        ({"conversation_id": 7, "reward": 1}, "conversation_id"),
        ({"response_id": "a"}, "reward"),
        ({"response_id": "a", "reward": math.nan}, "reward"),
        ({"response_id": "a", "reward": math.inf}, "reward"),
        ({"response_id": "a", "reward": True}, "reward"),
        ({"response_id": "a", "reward": "1"}, "reward"),
        ({"response_id": "a", "reward": 1, "score": 2}, "score"),
        ({"response_id": "a", "reward": 1, "comment": "x" * 4097}, "comment"),
        ({"response_id": "a", "reward": 1, "comment": ["no"]}, "comment"),
    ]
    for body, field in refused:
        status, reply = http(address, "/v1/feedback", body)
        assert status == 400 and reply["error"]["param"] == field, (body, reply)
        assert field in reply["error"]["message"] and reply["error"]["type"] == "invalid_request_error"
    assert http(address, "/v1/feedback", {"response_id": "a", "reward": 0, "comment": "x" * 4096})[0] == 200
    assert len(read_records(recording.dir, "feedback")[0]) == len(records) + 1

    status, reply = http(cpu_server, "/v1/feedback", {"response_id": "a", "reward": 1})  # records nothing
    assert status == 404 and "--record-dir" in reply["error"]["message"], reply
    if auth.run_token() is not None:
        anonymous = urllib.request.Request(auth.url(address, "/v1/feedback"), method="POST",
                                           data=json.dumps({"response_id": "a", "reward": 1}).encode(),
                                           headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused_anonymous:
            auth.opener().open(anonymous, timeout=30)
        assert refused_anonymous.value.code == 401
        assert len(read_records(recording.dir, "feedback")[0]) == len(records) + 1


def test_an_old_journal_is_sealed_by_the_timer(recording):
    async def go():
        async with client(recording.address) as c:
            return await c.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)

    reply = run(go())
    deadline = time.monotonic() + 30  # --record-rotate-s 2, checked every 2 s
    while files(recording.dir, "requests", ".jsonl"):
        assert time.monotonic() < deadline, "the journal was never sealed by age"
        time.sleep(0.2)
    in_shards = {r["sample_id"] for shard in files(recording.dir, "requests", ".parquet")
                 for r in read_shard(shard, "requests")}
    assert f"{reply.id}/0" in in_shards


def test_kill_9_loses_no_answered_request_and_the_restart_seals_what_it_left(tiny_model_dir, tmp_path):
    traffic = tmp_path / "traffic"
    now = time.time()
    with TrafficLog(traffic, "requests", "retired") as log:  # a shard of records ten days old
        log.append(a_request("ten-days-old", now - 10 * DAY))
    (old_shard,) = files(traffic, "requests", ".parquet")
    server = start_cpu_server(tiny_model_dir, tmp_path, "--record-dir", str(traffic))

    async def go():
        async with client(server.address) as c:
            tasks = [asyncio.create_task(c.chat.completions.create(
                model="m", messages=[{"role": "user", "content": f"question {i}"}], n=1 + i % 2,
                max_tokens=2 if i % 3 else 800, extra_body={"ignore_eos": True})) for i in range(9)]
            answered, pending = [], set(tasks)
            while len(answered) < 3:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                answered += [t.result() for t in done if t.exception() is None]
            os.killpg(server.popen.pid, signal.SIGKILL)  # mid-traffic: the long generations are running
            late = await asyncio.gather(*pending, return_exceptions=True)
            return answered + [r for r in late if not isinstance(r, BaseException)], len(late)

    try:
        answered, cut_off = run(go())
    finally:
        server.stop()
    assert cut_off > 0 and len(answered) >= 3
    acknowledged = {f"{reply.id}/{choice.index}" for reply in answered for choice in reply.choices}
    counts = sample_counts(traffic)
    assert all(counts[s] == 1 for s in acknowledged), counts
    records, problems = read_records(traffic, "requests")
    assert problems == [] and acknowledged <= {r["sample_id"] for r in records}
    (orphan,) = files(traffic, "requests", ".jsonl")

    # a journal whose writer died mid-append: three whole lines, then half of a fourth
    torn = traffic / "requests" / "deadhost_1-1-1-000000.jsonl"
    whole = [a_request(f"torn-{i}", now) for i in range(3)]
    torn.write_bytes(b"".join(map(journal_line, whole)) + journal_line(a_request("torn-3", now))[:40])

    restarted = start_cpu_server(tiny_model_dir, tmp_path, "--record-dir", str(traffic),
                                 "--record-retention-days", "1", "--record-rotate-bytes", "3000")
    try:
        assert files(traffic, "requests", ".jsonl") == []  # both sealed as the server started
        assert not old_shard.exists()  # retention: its newest record is older than a day
        for journal in (orphan, torn):
            assert read_shard(journal.with_suffix(".parquet"), "requests")
        sealed = {r["sample_id"] for r in read_shard(torn.with_suffix(".parquet"), "requests")}
        assert sealed == {"torn-0/0", "torn-1/0", "torn-2/0"}

        async def sequential():
            async with client(restarted.address) as c:
                return [await c.chat.completions.create(model="m", messages=MESSAGES, max_tokens=20)
                        for _ in range(5)]

        later = run(sequential())
    finally:
        restarted.stop()  # a clean stop seals its journal
    writer = f"127.0.0.1_{restarted.address.rsplit(':', 1)[1]}-{restarted.popen.pid}-"
    assert len([p for p in files(traffic, "requests", ".parquet") if p.name.startswith(writer)]) >= 2  # by size
    assert files(traffic, "requests", ".jsonl") == [] and files(traffic, "feedback", ".jsonl") == []
    counts = sample_counts(traffic)
    expected = acknowledged | {f"{r.id}/0" for r in later} | sealed
    assert all(counts[s] == 1 for s in expected), counts
    records, problems = read_records(traffic, "requests")
    assert problems == [] and expected <= {r["sample_id"] for r in records}
    assert "torn-3/0" not in counts and "ten-days-old/0" not in counts


def test_recovery_keeps_the_valid_lines_of_a_corrupt_journal_and_names_the_bad_one(tmp_path, caplog):
    now = time.time()
    folder = tmp_path / "requests"
    folder.mkdir()
    journal = folder / "gone_1-2-3-000004.jsonl"
    bad = json.loads(journal_line(a_request("bad", now)))
    bad["record"]["reply"] = "changed after its checksum"
    fieldless = {"sample_id": "c/0", "created_at": now}  # its checksum is right, its fields are not a request's
    journal.write_bytes(journal_line(a_request("a", now)) + json.dumps(bad).encode() + b"\n"
                        + journal_line(fieldless) + journal_line(a_request("b", now + 1)) + b'{"sha256": "0", "rec')
    records, problems = read_records(tmp_path, "requests")  # read as an open journal, without its lock
    assert [r["sample_id"] for r in records] == ["a/0", "b/0"]
    assert problems == [f"{journal}: line {n} is corrupt (bad JSON, checksum or fields)" for n in (2, 3)]
    with caplog.at_level(logging.INFO):
        assert recover_journals(tmp_path) == [str(journal.with_suffix(".parquet"))]
    assert not journal.exists()
    assert [r["sample_id"] for r in read_shard(journal.with_suffix(".parquet"), "requests")] == ["a/0", "b/0"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(journal) in w and "2, 3" in w for w in warnings), warnings
    assert any("torn" in r.getMessage() for r in caplog.records)


def test_rotation_by_size_and_age_and_retention(tmp_path):
    now = time.time()
    with TrafficLog(tmp_path, "feedback", "sizes", rotate_bytes=700) as log:
        for i in range(6):
            log.append(a_feedback(f"fb-{i}", now + i))
    assert len(files(tmp_path, "feedback", ".parquet")) >= 2 and files(tmp_path, "feedback", ".jsonl") == []
    assert [r["feedback_id"] for r in read_records(tmp_path, "feedback")[0]] == [f"fb-{i}" for i in range(6)]

    log = TrafficLog(tmp_path, "requests", "ages", rotate_s=10)
    log.append(a_request("young", now))
    assert log.maybe_rotate(time.time() + 5) is None and len(files(tmp_path, "requests", ".jsonl")) == 1
    assert log.maybe_rotate(time.time() + 11).endswith("ages-000000.parquet")
    log.rotate_s = 0.05  # an append checks the age too
    log.append(a_request("second", now))
    time.sleep(0.1)
    log.append(a_request("third", now))
    assert [p.name for p in files(tmp_path, "requests", ".parquet")] == ["ages-000000.parquet", "ages-000001.parquet"]
    log.close()
    with pytest.raises(RuntimeError, match="closed"):
        log.append(a_request("late", now))

    for kind, record in (("requests", a_request("old", now - 3 * DAY)), ("feedback", a_feedback("old", now - 3 * DAY))):
        with TrafficLog(tmp_path, kind, "old") as old:
            old.append(record)
    open_journal = TrafficLog(tmp_path, "requests", "open")
    open_journal.append(a_request("old-but-open", now - 3 * DAY))
    assert remove_older_than(tmp_path, 0, now=now) == []
    removed = remove_older_than(tmp_path, 2, now=now)
    assert sorted(Path(p).name for p in removed) == ["old-000000.parquet", "old-000000.parquet"]
    kept = {r["sample_id"] for r in read_records(tmp_path, "requests")[0]}
    assert kept == {"young/0", "second/0", "third/0", "old-but-open/0"}
    assert [r["feedback_id"] for r in read_records(tmp_path, "feedback")[0]] == [f"fb-{i}" for i in range(6)]
    open_journal.close()


def test_an_altered_shard_is_named_and_its_records_left_out(tmp_path):
    now = time.time()
    for name in ("intact", "flipped", "rewritten"):
        with TrafficLog(tmp_path, "requests", name) as log:
            log.append_many([a_request(f"{name}-{i}", now + i) for i in range(3)])
    folder = tmp_path / "requests"
    flipped, rewritten = folder / "flipped-000000.parquet", folder / "rewritten-000000.parquet"
    # the last byte of the completions' logprobs: inside the data of their last page (a page's header comes first)
    column = pq.ParquetFile(flipped).metadata.row_group(0).column(REQUEST_FIELDS.index("logprobs"))
    data = bytearray(flipped.read_bytes())
    start = column.dictionary_page_offset if column.has_dictionary_page else column.data_page_offset
    data[start + column.total_compressed_size - 1] ^= 0xFF
    flipped.write_bytes(bytes(data))
    # a value changed by a writer that kept the metadata (a valid Parquet file, the wrong records)
    table = pq.read_table(rewritten)
    rows = table.to_pylist()
    rows[1]["completion_ids"] = [9, 9]
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), rewritten)
    records, problems = read_records(tmp_path, "requests")
    assert [r["sample_id"] for r in records] == [f"intact-{i}/0" for i in range(3)]
    assert sorted(p.split(": ")[0] for p in problems) == sorted([str(flipped), str(rewritten)]), problems
    for shard in (flipped, rewritten):
        with pytest.raises(ShardError, match=str(shard)):
            read_shard(shard, "requests")
    assert canonical_json({"b": 1, "a": "é"}) == '{"a":"é","b":1}'


def test_a_launcher_passes_recording_flags_to_the_cpu_server_only(tmp_path):
    from areal_pipeline.config import InferenceConfig
    from areal_pipeline.inference.launcher import server_processes
    from areal_pipeline.inference.server_args import build_arg_parser

    flags = ["--record-dir", str(tmp_path / "traffic"), "--record-retention-days", "7"]
    (server,) = server_processes("model", InferenceConfig(num_servers=1), 0, tmp_path, extra_args=flags)
    args = build_arg_parser().parse_args(server.command[3:])
    assert (args.record_dir, args.record_retention_days, args.record_rotate_bytes, args.record_rotate_s) == \
        (str(tmp_path / "traffic"), 7.0, 64 << 20, 3600.0)
    assert server.fork[1][-len(flags):] == flags  # the forked server's argv too
    with pytest.raises(ValueError, match="CPU server"):
        server_processes("model", InferenceConfig(num_servers=1, backend="sglang"), 0, tmp_path, extra_args=flags)

"""The experiment trackers (areal_pipeline/trackers/): Weights & Biases in its offline mode and MLflow against a
real local tracking server (MLflow's own environment, .venv-mlflow: `make setup-mlflow`), fed by real short `train`
flow runs on Prefect's engine, continued under the same run id; a tracker that cannot be reached leaves the run
going; the `trackers` config section and its checks."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from areal_pipeline.config import ConfigError, load
from areal_pipeline.forkserver import processes_of
from areal_pipeline.utils import find_free_port
from test_flows import REPO, _artifacts, fast_overrides, wait_until

MLFLOW_SERVER = REPO / ".venv-mlflow" / "bin" / "mlflow"


# --- Reading what W&B wrote offline ---------------------------------------------------------------------------
# W&B has no public reader of an offline run's `run-<id>.wandb` file. It is LevelDB's log format (32 KiB blocks
# of chunks, each a 7-byte header: CRC, length, type FULL/FIRST/MIDDLE/LAST) after W&B's 7-byte header, each record
# a `wandb_internal_pb2.Record`. If a W&B upgrade changes that, this reader fails the tests loudly.
_BLOCK, _FULL, _FIRST, _LAST = 32768, 1, 2, 4


def wandb_records(path: Path):
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} does not start with W&B's header: {data[:7]!r}"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (kind == 0 and length == 0):  # a block's padding
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (_FULL, _FIRST) else pending + chunk
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def _ends_with_its_exit(path: Path) -> bool:
    from google.protobuf.message import DecodeError

    try:
        return any(record.WhichOneof("record_type") == "exit" for record in wandb_records(path))
    except DecodeError:  # a record still being written
        return False


def wandb_offline_run(wandb_dir: Path, wandb_id: str) -> tuple[list[dict], dict, list[str]]:
    """Every offline directory of W&B run `wandb_id` (a continued run writes one more): (history rows in the order
    written, the newest config, notes)."""
    history, config, notes = [], {}, []
    files = sorted((wandb_dir / "wandb").glob(f"offline-run-*-{wandb_id}*/run-{wandb_id}.wandb"))
    assert files, f"no offline run {wandb_id} under {wandb_dir}: {sorted((wandb_dir / 'wandb').iterdir())}"
    # W&B's service process may still be writing a file when `finish` has returned: each ends with its exit record
    wait_until(lambda: all(_ends_with_its_exit(f) for f in files), 30, f"W&B to write the exit records of {files}")
    for path in files:
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                for item in record.history.item})
            elif kind == "run":
                config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
                notes.append(record.run.notes)
            elif kind == "config":
                config.update({item.key: json.loads(item.value_json) for item in record.config.update})
    return history, config, notes


# --- A real MLflow tracking server ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    if not MLFLOW_SERVER.is_file():
        pytest.skip(f"no MLflow tracking server at {MLFLOW_SERVER} (make setup-mlflow)")
    home = tmp_path_factory.mktemp("mlflow-server")
    port = find_free_port()
    log = open(home / "server.log", "wb")
    process = subprocess.Popen([str(MLFLOW_SERVER), "server", "--host", "127.0.0.1", "--port", str(port),
                                "--workers", "1", "--backend-store-uri", f"sqlite:///{home / 'mlflow.db'}",
                                "--artifacts-destination", str(home / "artifacts")],
                               # the tracking server alone: MLflow 3's job runner (its GenAI jobs, 8 more processes
                               # each importing mlflow) is nothing a run's tracking uses
                               env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=5):
                    break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"MLflow server did not come up: {(home / 'server.log').read_text()[-3000:]}")
                time.sleep(0.5)
        yield uri
    finally:
        for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            try:
                os.killpg(process.pid, sig)
                process.wait(wait)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        log.close()


def _train(tmp_path, tiny_model_dir, run_id: str, iterations: int, *extra: str):
    from flows.train import train

    overrides = fast_overrides(tmp_path, tiny_model_dir, run_id=run_id, iterations=iterations)
    return train(config_path=str(REPO / "configs/tiny_cpu.yaml"),
                 overrides=[o for o in overrides if not o.startswith("eval_freq")] + ["eval_freq=0", *extra])


async def _flow_run_and_flow(flow_run_id: str):
    from prefect.client.orchestration import get_client

    async with get_client() as client:
        flow_run = await client.read_flow_run(flow_run_id)
        return flow_run, await client.read_flow(flow_run.flow_id)


def _prefect_flow_run_of(url: str):
    assert "/flow-runs/flow-run/" in url, url
    return asyncio.run(_flow_run_and_flow(url.rstrip("/").rsplit("/", 1)[1]))


def test_wandb_and_mlflow_get_every_iteration_the_config_and_the_prefect_link_across_a_continued_run(
        prefect_api, tiny_model_dir, tmp_path, mlflow_server, monkeypatch):
    from mlflow import MlflowClient

    from areal_pipeline.trackers.mlflow_run import PREFECT_URL_TAG, RUN_ID_TAG
    from areal_pipeline.trackers.wandb_run import wandb_run_id

    wandb_dir = tmp_path / "wandb-files"
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(wandb_dir))
    before = {p.pid for p in processes_of(os.getpid(), forkserver=False)}  # e.g. session fixtures' servers
    trackers = ["trackers.wandb.enabled=true", "trackers.wandb.mode=offline", "trackers.wandb.tags=[grpo]",
                "trackers.mlflow.enabled=true", f"trackers.mlflow.tracking_uri={mlflow_server}",
                "trackers.mlflow.experiment=tracker-test"]
    # evaluated before iteration 1 (evaluate-0: step 0 in the trackers), then at iteration 4 and at each run's last
    _train(tmp_path, tiny_model_dir, "tracked", 2, *trackers, "eval_freq=4")
    run_dir = tmp_path / "tracked"
    # continued under the same run id: iterations 1-2 are finished, 3-4 run now
    _train(tmp_path, tiny_model_dir, "tracked", 4, *trackers, "eval_freq=4")
    initial = json.loads((run_dir / "iter_0" / "eval.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2, 3, 4]

    # W&B: one run (by its id) holds every iteration once, at its iteration's step, with the config and the link
    wandb_id = wandb_run_id("tracked", run_dir)
    history, config, notes = wandb_offline_run(wandb_dir, wandb_id)
    assert [row["_step"] for row in history] == [0, 1, 2, 3, 4]
    assert history[0]["eval_pass_at_1"] == pytest.approx(initial["pass_at_1"]) and "reward_mean" not in history[0]
    for row, record in zip(history[1:], records):
        assert row["reward_mean"] == pytest.approx(record["reward_mean"])
        assert row["grad_norm"] == pytest.approx(record["grad_norm"])
    assert config["run_id"] == "tracked" and config["total_iterations"] == 4
    assert config["rollout"]["batch_size"] == 4 and config["trackers"]["wandb"]["tags"] == ["grpo"]
    assert len(notes) == 2 and notes[1] == f"prefect: {config['links']['prefect']}"
    for note in notes:  # each train flow run links its own page
        flow_run, flow = _prefect_flow_run_of(note.removeprefix("prefect: "))
        assert flow.name == "train" and flow_run.state.is_completed()
    assert notes[0] != notes[1]

    # MLflow: one run, found again by the run id; each metric's history one value per iteration
    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name("tracker-test")
    found = client.search_runs([experiment.experiment_id], filter_string=f"tags.`{RUN_ID_TAG}` = 'tracked'")
    assert len(found) == 1
    mlflow_run = client.get_run(found[0].info.run_id)
    history = client.get_metric_history(mlflow_run.info.run_id, "reward_mean")
    assert sorted(m.step for m in history) == [1, 2, 3, 4]
    assert [m.value for m in sorted(history, key=lambda m: m.step)] == pytest.approx([r["reward_mean"] for r in records])
    assert [m.step for m in client.get_metric_history(mlflow_run.info.run_id, "time_rollout")] == [1, 2, 3, 4]
    passes = sorted(client.get_metric_history(mlflow_run.info.run_id, "eval_pass_at_1"), key=lambda m: m.step)
    assert [m.step for m in passes] == [0, 2, 4] and passes[0].value == pytest.approx(initial["pass_at_1"])
    params = mlflow_run.data.params
    assert params["run_id"] == "tracked" and params["rollout.batch_size"] == "4" and params["seed"] == "1"
    assert params["total_iterations"] == "2"  # params are immutable: the first run's value stays
    assert mlflow_run.data.tags[PREFECT_URL_TAG] == notes[1].removeprefix("prefect: ")
    assert mlflow_run.info.status == "FINISHED" and mlflow_run.info.run_name == "tracked"

    # Prefect links to each tracker's run
    state = json.loads((run_dir / "trackers.json").read_text())
    assert state["wandb"]["last_step"] == 4 and state["mlflow"]["last_step"] == 4
    mlflow_links = asyncio.run(_artifacts("tracked-mlflow-run"))
    assert len(mlflow_links) == 2 and {a.type for a in mlflow_links} == {"markdown"}  # Prefect renders links as such
    url = f"{mlflow_server}/#/experiments/{experiment.experiment_id}/runs/{mlflow_run.info.run_id}"
    assert all(f"({url})" in a.data for a in mlflow_links), [a.data for a in mlflow_links]
    wandb_links = asyncio.run(_artifacts("tracked-wandb-run"))
    assert len(wandb_links) == 2 and all(f"(file://{wandb_dir.resolve()}/wandb/offline-run-" in a.data
                                         and wandb_id in a.data for a in wandb_links), [a.data for a in wandb_links]
    left = [p for p in processes_of(os.getpid(), forkserver=False) if p.pid not in before]
    assert not left, [(p.pid, p.cmdline()) for p in left]  # nothing of the run left
    assert not [p for p in psutil.Process().children(recursive=True) if p.name().startswith("wandb")]


def wandb_exit_code(wandb_dir: Path, wandb_id: str) -> int:
    """The exit code W&B recorded when the (last) offline run of `wandb_id` finished."""
    (path, *_) = sorted((wandb_dir / "wandb").glob(f"offline-run-*-{wandb_id}*/run-{wandb_id}.wandb"), reverse=True)
    exits = [record.exit for record in wandb_records(path) if record.WhichOneof("record_type") == "exit"]
    assert len(exits) == 1, path
    return exits[0].exit_code


def test_a_failed_run_ends_its_tracker_runs_as_failed_with_what_it_logged(prefect_api, tiny_model_dir, tmp_path,
                                                                          mlflow_server, monkeypatch):
    """Iteration 2's update refused for good (a 4xx: not retried): the train flow fails, and the trackers' runs end
    FAILED (MLflow) and with exit code 1 (W&B), holding iteration 1 and nothing of iteration 2."""
    from mlflow import MlflowClient

    from areal_pipeline.trackers.mlflow_run import RUN_ID_TAG
    from areal_pipeline.trackers.wandb_run import wandb_run_id
    from areal_pipeline.training.client import TrainerClient, TrainerError

    wandb_dir = tmp_path / "wandb-files"
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(wandb_dir))
    real_call = TrainerClient.call

    def call(self, cmd, *args, **kwargs):
        if cmd == "train" and kwargs.get("iteration") == 2:
            raise TrainerError("refused for this test", "bad_arguments", 400)
        return real_call(self, cmd, *args, **kwargs)

    monkeypatch.setattr(TrainerClient, "call", call)
    with pytest.raises(TrainerError, match="refused for this test"):
        _train(tmp_path, tiny_model_dir, "fails", 3, "trackers.wandb.enabled=true", "trackers.wandb.mode=offline",
               "trackers.mlflow.enabled=true", f"trackers.mlflow.tracking_uri={mlflow_server}",
               "trackers.mlflow.experiment=tracker-failures")
    records = [json.loads(line) for line in (tmp_path / "fails" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1]

    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name("tracker-failures")
    (found,) = client.search_runs([experiment.experiment_id], filter_string=f"tags.`{RUN_ID_TAG}` = 'fails'")
    assert found.info.status == "FAILED" and found.info.end_time is not None
    history = client.get_metric_history(found.info.run_id, "reward_mean")
    assert [(m.step, m.value) for m in history] == [(1, pytest.approx(records[0]["reward_mean"]))]

    wandb_id = wandb_run_id("fails", tmp_path / "fails")
    steps = [row["_step"] for row in wandb_offline_run(wandb_dir, wandb_id)[0]]
    assert 1 in steps and 2 not in steps
    assert wandb_exit_code(wandb_dir, wandb_id) == 1


def test_a_cancelled_run_ends_as_killed_in_mlflow_and_with_w_b_s_cancel_code(tmp_path, mlflow_server, monkeypatch):
    """The end a cancelled train flow gives its trackers (flows/train.py: `tracking.finish(run, "cancelled")`), on
    the real MLflow server and an offline W&B run; a failed run's end is the test above."""
    from mlflow import MlflowClient

    from areal_pipeline.run_spec import load_config
    from areal_pipeline.trackers import Trackers
    from areal_pipeline.trackers.mlflow_run import RUN_ID_TAG
    from areal_pipeline.trackers.wandb_run import wandb_run_id

    wandb_dir = tmp_path / "wandb-files"
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(wandb_dir))
    cfg = load_config(REPO / "configs/tiny_cpu.yaml", [
        f"output_dir={tmp_path}", "run_id=stopped", "trackers.wandb.enabled=true", "trackers.wandb.mode=offline",
        "trackers.mlflow.enabled=true", f"trackers.mlflow.tracking_uri={mlflow_server}",
        "trackers.mlflow.experiment=tracker-cancelled"])
    run_dir = tmp_path / "stopped"
    run_dir.mkdir()
    trackers = Trackers.of(cfg)
    trackers.start("stopped", {"run_id": "stopped"}, {})
    trackers.log({"iteration": 1, "reward_mean": 0.25})
    trackers.finish("cancelled")

    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name("tracker-cancelled")
    (found,) = client.search_runs([experiment.experiment_id], filter_string=f"tags.`{RUN_ID_TAG}` = 'stopped'")
    assert found.info.status == "KILLED"
    assert [(m.step, m.value) for m in client.get_metric_history(found.info.run_id, "reward_mean")] == [(1, 0.25)]
    assert wandb_exit_code(wandb_dir, wandb_run_id("stopped", run_dir)) == 255


def test_a_tracking_server_that_is_down_is_warned_about_and_the_run_completes(prefect_api, tiny_model_dir, tmp_path,
                                                                               caplog, dead_address):
    with socket.socket() as listening:  # takes connections into its backlog, never answers: a hung server
        listening.bind(("127.0.0.1", 0))
        listening.listen(8)
        hung = f"http://127.0.0.1:{listening.getsockname()[1]}"
        down = f"http://{dead_address}"
        for uri in (down, hung):
            run_id = "down" if uri == down else "hung"
            started = time.monotonic()
            with caplog.at_level(logging.WARNING, logger="areal_pipeline.trackers"):
                result = _train(tmp_path, tiny_model_dir, run_id, 1, "trackers.mlflow.enabled=true",
                                f"trackers.mlflow.tracking_uri={uri}", "trackers.timeout=3")
            assert result["iterations"] == 1 and result["run_id"] == run_id
            warnings = [r.getMessage() for r in caplog.records if r.name == "areal_pipeline.trackers"]
            assert any("tracker mlflow left out of this run" in w and "start" in w for w in warnings), warnings
            assert time.monotonic() - started < 300
            assert not asyncio.run(_artifacts(f"{run_id}-mlflow-run"))
            caplog.clear()


def test_a_hung_tracker_call_is_abandoned_at_its_deadline(tmp_path, caplog):
    from areal_pipeline.trackers import Trackers

    class Blocks:
        """A tracker whose log never returns, as one stuck on a network call does."""

        name = "blocks"

        def start(self, run_id, config, links):
            return "somewhere"

        def log(self, step, metrics):
            time.sleep(3600)

        def finish(self, status):
            pass

    trackers = Trackers([Blocks()], tmp_path, timeout=1.0)
    assert trackers.start("r", {}, {}) == {"blocks": "somewhere"}
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="areal_pipeline.trackers"):
        trackers.log({"iteration": 1, "reward_mean": 0.5})
    assert time.monotonic() - started < 60 and trackers.active == []  # not the call's hour
    assert "no answer within 1 s" in caplog.text
    trackers.log({"iteration": 2, "reward_mean": 0.5})  # left out: not called again
    assert "last_step" not in json.loads((tmp_path / "trackers.json").read_text())["blocks"]


# --- The config ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("package,override,extra", [
    ("wandb", "trackers.wandb.enabled=true", "pip install 'areal-pipeline[wandb]'"),
    ("mlflow", "trackers.mlflow.enabled=true", "pip install 'areal-pipeline[mlflow]'")])
def test_a_tracker_without_its_package_is_a_config_error_naming_the_extra(package, override, extra, monkeypatch):
    assert importlib.util.find_spec(package) is not None, f"{package} must be installed for the tracker tests"
    monkeypatch.setitem(sys.modules, package, None)  # Python's way to make a module unimportable
    with pytest.raises(ConfigError) as err:
        load(None, [override])
    assert f"{override.replace('true', 'True')}: needs the {package} package" in str(err.value)
    assert extra in str(err.value)


def test_the_former_tensorboard_key_still_sets_trackers_tensorboard(tmp_path):
    saved = tmp_path / "config.yaml"
    saved.write_text("run_id: old\ntensorboard: false\n")  # a run's config.yaml saved before the key moved
    assert load(saved).trackers.tensorboard is False and load(saved).run_id == "old"
    saved.write_text("tensorboard: false\ntrackers:\n  tensorboard: false\n")
    with pytest.raises(ConfigError, match="'tensorboard' is the former name of 'trackers.tensorboard'"):
        load(saved)


def test_a_missing_tensorboard_package_is_named_with_its_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # what importlib finds where the package is not installed
    assert importlib.util.find_spec("tensorboard") is None
    with pytest.raises(ConfigError, match=r"trackers.tensorboard=True: needs the tensorboard package.*"
                                          r"pip install 'areal-pipeline\[tensorboard\]'"):
        load(None, ["tensorboard=true"])


def test_tensorboard_gets_every_iteration(tmp_path):
    from areal_pipeline.trackers import Trackers

    if importlib.util.find_spec("tensorboard") is None:  # under CI a skip fails (conftest.py): make setup installs it
        pytest.skip("the tensorboard package is not installed (pip install 'areal-pipeline[tensorboard]')")
    cfg = load(None, ["tensorboard=true", f"output_dir={tmp_path}", "run_id=tb"])
    trackers = Trackers.of(cfg)
    assert trackers.start("tb", {}, {"prefect": "http://x/flow-runs/flow-run/1"}) == {
        "tensorboard": str(tmp_path / "tb" / "tensorboard")}
    for k in (1, 2, 2, 3):  # the repeated 2: a continued run's iteration already logged
        trackers.log({"iteration": k, "reward_mean": k / 10})
    trackers.finish("completed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb" / "tensorboard"))
    events.Reload()
    assert [(e.step, round(e.value, 3)) for e in events.Scalars("reward_mean")] == [(1, 0.1), (2, 0.2), (3, 0.3)]


def test_a_step_a_tracker_already_has_is_not_logged_again(tmp_path, monkeypatch):
    """A run that stopped after a tracker took iteration k but before k was recorded as finished reports k again."""
    from areal_pipeline.trackers import Trackers
    from areal_pipeline.trackers.wandb_run import WandbTracker, wandb_run_id

    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-files"))
    cfg = load(None, [f"output_dir={tmp_path}", "run_id=again", "trackers.wandb.enabled=true",
                      "trackers.wandb.mode=offline"])
    for steps in ([1, 2], [2, 3]):  # the second a continued run, given iteration 2 again
        trackers = Trackers([WandbTracker(cfg.trackers.wandb, cfg.run_dir)], cfg.run_dir)
        where = trackers.start("again", {"seed": 1}, {})
        assert Path(where["wandb"]).is_dir()
        for k in steps:
            trackers.log({"iteration": k, "reward_mean": k / 10, "note": "not a number", "ok": True})
        trackers.finish("completed")
    history, config, _ = wandb_offline_run(tmp_path / "wandb-files", wandb_run_id("again", cfg.run_dir))
    assert [(row["_step"], row["reward_mean"]) for row in history] == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert all("note" not in row and "ok" not in row for row in history) and config["seed"] == 1

"""The quiet console of `areal-pipeline train`: a progress line and the summary on the terminal, every record in
the run's log file and the Prefect run logs, `--verbose` for everything on the terminal; real runs."""

from __future__ import annotations

import asyncio
import io
import logging
import os
import re

from areal_pipeline import console
from areal_pipeline.console import ProgressLine, quiet_console
from test_flows import cli, fast_overrides, wait_until


class Clock:
    """The console's clock, moved by the test: seconds an iteration exact."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


def _ansi_stripped(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)


def test_the_progress_line_on_a_pipe_is_plain_lines_about_every_tenth_of_the_run(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(console, "time", clock)
    piped = io.StringIO()  # not a terminal: plain lines by default
    line = ProgressLine("r", piped)
    line.started(3, 102)  # a continued run: iterations 1..2 were finished before
    for k in range(3, 103):
        clock.now += 2.0
        line.iteration(k, {"reward_mean": 0.5, "eval_pass_at_1": 0.25 if k == 12 else None})
    line.finished()
    assert piped.getvalue().splitlines() == [
        "run r: iterations 1..2 are finished; continuing at 3",
        "r [----------------------------] 2/102  reward -  pass@1 -  starting",
        "r [##--------------------------] 12/102  reward 0.500  pass@1 0.250  2.00 s/it  ETA 3:00",
        "r [#####-----------------------] 22/102  reward 0.500  pass@1 0.250  2.00 s/it  ETA 2:40",
        "r [########--------------------] 32/102  reward 0.500  pass@1 0.250  2.00 s/it  ETA 2:20",
        "r [###########-----------------] 42/102  reward 0.500  pass@1 0.250  2.00 s/it  ETA 2:00",
        "r [##############--------------] 52/102  reward 0.500  pass@1 0.250  2.00 s/it  ETA 1:40",
        "r [################------------] 62/102  reward 0.500  pass@1 0.250  2.00 s/it  ETA 1:20",
        "r [###################---------] 72/102  reward 0.500  pass@1 0.250  2.00 s/it  ETA 1:00",
        "r [######################------] 82/102  reward 0.500  pass@1 0.250  2.00 s/it  ETA 0:40",
        "r [#########################---] 92/102  reward 0.500  pass@1 0.250  2.00 s/it  ETA 0:20",
        "r [############################] 102/102  reward 0.500  pass@1 0.250  2.00 s/it  ETA 0:00",
    ]


def as_a_terminal(monkeypatch) -> None:
    """What rich reads of the environment for a stream it is told is a terminal: its width, and that it is no
    dumb terminal (one that cannot move the cursor)."""
    monkeypatch.setenv("COLUMNS", "160")
    monkeypatch.setenv("TERM", "xterm")


def test_the_progress_line_on_a_terminal_is_redrawn_in_place_with_records_above_it(monkeypatch):
    as_a_terminal(monkeypatch)
    clock = Clock()
    monkeypatch.setattr(console, "time", clock)
    live = io.StringIO()
    line = ProgressLine("r", live, live=True)
    line.started(1, 4)
    # the cursor is shown while the line is drawn: a command that ends by os._exit leaves the terminal one
    assert live.getvalue().endswith("\x1b[?25h")
    for k in range(1, 5):
        clock.now += 1.5
        line.iteration(k, {"reward_mean": 0.25 * k, "eval_pass_at_1": 0.5 if k == 2 else None})
        if k == 2:
            line.write("a record")
    line.finished()
    text = _ansi_stripped(live.getvalue())
    # one line on the screen, rewritten per event: the frames are separated by carriage returns, not newlines
    assert text.count("\n") == 2 and text.endswith("\n")
    frames = [frame for frame in re.split(r"[\r\n]", text) if frame]
    assert frames[0] == "r " + "━" * 28 + " 0/4  reward -  pass@1 -  starting"
    assert re.fullmatch(r"r [━╸╺]{28} 1/4  reward 0\.250  pass@1 -  1\.50 s/it  ETA 0:04", frames[1])
    assert frames[-1] == "r " + "━" * 28 + " 4/4  reward 1.000  pass@1 0.500  1.50 s/it  ETA 0:00"
    # the record is written on a line of its own, and the progress line drawn again below it
    assert re.search(r"\ra record\nr [━╸╺]{28} 2/4  reward 0\.500  pass@1 0\.500  ", text)


def test_the_progress_line_shows_the_episodes_that_failed_in_the_last_iteration():
    out = io.StringIO()
    line = ProgressLine("r", out, live=False)
    line.started(1, 2)
    line.iteration(1, {"reward_mean": 0.5, "failures/reward_timeout": 1, "failures/retrieval": 2,
                       "retries/retrieval": 5, "failure_rate": 0.05})
    assert "reward 0.500  pass@1 -  fail 3 (retrieval 2, reward_timeout 1)  " in line.text()
    line.iteration(2, {"reward_mean": 0.5, "failure_rate": 0.0, "retries/agent": 1})
    assert "fail" not in line.text()  # retries that passed are no failure


def test_log_records_go_to_the_file_and_warnings_above_the_line(tmp_path, monkeypatch):
    as_a_terminal(monkeypatch)
    stream = io.StringIO()
    logger = logging.getLogger("areal_pipeline.test_console")
    logger.setLevel(logging.INFO)  # as the command line sets the library's loggers
    with quiet_console("r", tmp_path / "r", stream=stream, live=True) as progress:
        progress.started(1, 2)
        logger.info("an info record")
        logger.warning("a warning record")
        progress.iteration(1, {"reward_mean": 0.5})
    text = _ansi_stripped(stream.getvalue())
    assert "an info record" not in text and "a warning record" in text
    # the warning is written on a cleared line, and the progress line drawn again after it
    assert re.search(r"\r[^\r\n]*WARNING areal_pipeline.test_console: a warning record\nr ━", text)
    assert text.endswith("\n")  # the line is left on the screen, the cursor below it
    log = (tmp_path / "r" / "logs" / "train.log").read_text()
    assert "INFO areal_pipeline.test_console: an info record" in log and "a warning record" in log


def test_verbose_prints_no_progress_line(tmp_path):
    stream = io.StringIO()
    with quiet_console("r", tmp_path / "r", verbose=True, stream=stream) as progress:
        logging.getLogger("areal_pipeline.test_console").warning("a warning record")
    assert progress is None and stream.getvalue() == ""


async def _run_logs(name: str):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName, LogFilter, LogFilterFlowRunId

    async with get_client() as client:
        (run,) = await client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name])))
        return await client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])))


def test_a_training_run_prints_a_progress_line_and_keeps_the_full_logs(prefect_api, tiny_model_dir, tmp_path):
    env = {**os.environ, "PREFECT_API_URL": prefect_api}
    run = cli("train", "--config", "configs/tiny_cpu.yaml",
              *fast_overrides(tmp_path, tiny_model_dir, run_id="quiet", iterations=3), env=env)
    out, _ = run.communicate(timeout=600)
    assert run.returncode == 0, out
    lines = out.strip().splitlines()
    assert len(lines) < 20, out  # not one line per node and run
    assert "Finished in state" not in out and "Beginning subflow run" not in out
    assert any(re.match(r"quiet \[#{28}\] 3/3  reward \d\.\d{3}  pass@1 \d\.\d{3}  \d+\.\d\d s/it  ETA 0:00", line)
               for line in lines), out
    assert "run quiet: 3 iterations in" in out and "mean reward, last" in out
    log = (tmp_path / "quiet" / "logs" / "train.log").read_text()
    assert "prefect.flow_runs [quiet/iter-3]: Finished in state Completed()" in log
    assert log.count("prefect.task_runs [") >= 3 * 4 and "areal_pipeline.inference.launcher" in log
    # the run's logs in Prefect are as full as before
    logs = wait_until(lambda: (lambda found: found if any("iteration 3: reward" in r.message for r in found) else None)(
        asyncio.run(_run_logs("quiet/iter-3"))), 30, "the iteration's logs in the Prefect API")
    assert any(r.message.startswith("Finished in state") for r in logs)

    verbose = cli("train", "--verbose", "--config", "configs/tiny_cpu.yaml",
                  *fast_overrides(tmp_path, tiny_model_dir, run_id="loud", iterations=3), env=env)
    out, _ = verbose.communicate(timeout=600)
    assert verbose.returncode == 0, out
    assert out.count("Finished in state Completed()") >= 3 * 4 and "quiet [" not in out and "loud [" not in out
    assert len(out.splitlines()) > 3 * len(lines)

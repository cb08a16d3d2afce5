"""Fault sweep (issue 20): kill -9 at each node of an iteration, killed servers and trainer, Ctrl-C and SIGTERM,
corrupt files, bad config values and data, hostile requests; each fault judged by what a user gets.

    python bench/faults.py [--quick] [--only SUBSTRING ...] [--keep]

The runs are real: `areal-pipeline train` / `evaluate` as subprocesses (each in its own session) on the embedded
tiny model with small settings (4 prompts x 4 samples, 8 new tokens, 3 iterations, a checkpoint and an evaluation
every iteration), each against a temporary Prefect API server of its own (no PREFECT_API_URL, as a user's first
run), all sharing one PREFECT_HOME under the sweep's temporary directory. A reference run that never fails is
made once; its final weights (checkpoints/step_3/model/model.safetensors) are what every rerun must reach.

How each fault is judged:
- kill (kill -9 of the run when an output of iteration 2 appears, i.e. as the next node starts; kill -9 of the
  inference server or the trainer rank mid-run; SIGINT / SIGTERM to the run's process group): survived = the
  run, or its rerun with the same run id, completes with final weights bitwise equal to the reference's, no
  process of the killed run is left (`forkserver.processes_of`: servers, trainer, forkserver, API server), and a
  stop signal ends the run within 10 s with status 128+signal and a message. Data lost = a file of an iteration finished
  before the kill (or of its checkpoint) missing, changed or rewritten after the rerun, or a rerun that did not
  continue after the finished iterations.
- corrupt (a byte flipped in, or the tail cut off, a rollout shard, a batch shard, a checkpoint's
  model.safetensors or optimizer.safetensors; a manifest deleted), in the state a run killed after iteration 2's
  batch leaves, then rerun; or a corrupt checkpoint given to `evaluate`: survived = the file is named (warning
  or last line) and either computed again (the rerun reaches the reference weights) or refused; never used
  silently. A deleted manifest has no file left to name: computing its output again is surviving.
- bad value (a config value, a missing or broken file): survived = non-zero exit with the key or file named in
  the last line of output, before anything starts: under 10 s of CPU time (the imports alone take ~4 s; the
  wall time, also shown, under 30 s on a busy machine) and nothing written in the run's output directory.
- request (to a real CPU inference server and BM25 retrieval server): survived = the expected status (4xx, or
  200 for /get_server_info) within 5 s with a message, /health answering in < 2 s meanwhile, the weights served
  unchanged after a refused weight update, and a normal request answered afterwards.
An unclear error is a failure whose last line (or reply) does not name the file, key or cause.

The full sweep (50 faults) takes ~9 minutes on 2 busy cores, --quick ~1.5 (one kill, one corruption, a few bad
values and requests). A run's logs are kept under the work directory when a fault does not survive (or --keep). Exit status 1 if data was lost or an error was unclear. The last line is one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import psutil

from areal_pipeline import auth
from areal_pipeline.checksums import sha256_file
from areal_pipeline.forkserver import processes_of
from areal_pipeline.processes import ServerProcess
from areal_pipeline.run_dir import RunPaths
from areal_pipeline.utils import find_free_port

REPO = Path(__file__).resolve().parents[1]

RUN_ID = "faults"
ITERATIONS = 3
SMALL = ["rollout.batch_size=4", "rollout.gconfig.n_samples=4", "rollout.gconfig.max_new_tokens=8",
         f"total_iterations={ITERATIONS}", "save_freq=1", "eval_freq=1", "eval_max_prompts=8",
         "trainer.optimizer.lr=1e-3", "dataset.arithmetic_train_size=64"]
FINAL_WEIGHTS = f"checkpoints/step_{ITERATIONS}/model/model.safetensors"
STOPPED_WITHIN_S = 10  # a stop signal ends the run
REJECTED_WITHIN_S = 10  # CPU seconds a command takes to reject a bad value (imports alone ~4 s)
REJECTED_WALL_S = 30  # its wall time, on a 2-core machine busy with other work
ANSWERED_WITHIN_S = 5  # a hostile request is answered
HEALTH_WITHIN_S = 2  # /health during a hostile request
RUN_TIMEOUT_S = 600
STACKS_WRITTEN_WITHIN_S = 15  # a hung command's stack dump, after SIGABRT


@dataclass
class Outcome:
    survived: bool
    note: str
    data_lost: bool = False
    unclear: bool = False


@dataclass
class Fault:
    name: str
    category: str  # kill | corrupt | bad value | request
    inject: Callable[["Sweep"], Outcome]
    quick: bool = False  # part of --quick


@dataclass
class Row:
    fault: Fault
    outcome: Outcome
    seconds: float

    @property
    def verdict(self) -> str:
        if self.outcome.data_lost:
            return "DATA LOST"
        if self.outcome.unclear:
            return "UNCLEAR"
        return "survived" if self.outcome.survived else "FAILED"


# ----- processes and files -----------------------------------------------------------------------------------
def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def module_of(argv: list[str]) -> Optional[str]:
    """The module a `python -m module ...` command line runs. A service forked from the forkserver writes its command
    line over the forkserver's as one string (procfs then shows it and empty arguments): split, it reads the same."""
    argv = [arg for arg in argv if arg]
    if len(argv) == 1:
        argv = argv[0].split()
    return argv[argv.index("-m") + 1] if "-m" in argv[:-1] else None


def short(text: str, limit: int = 150) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def gone_within(pid: int, seconds: float) -> list[str]:
    """What is left of `pid`'s services after waiting up to `seconds`; those left are killed (by pid)."""
    if wait_until(lambda: not processes_of(pid), seconds):
        return []
    names = []
    for proc in processes_of(pid):
        try:
            names.append(f"{proc.pid} {' '.join(proc.cmdline()[1:4])}")
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    return names


def wait_until(predicate: Callable[[], object], timeout: float, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - max(10, len(data) // 10)])


def finished_files(run_dir: Path) -> dict[str, tuple[str, int, int]]:
    """sha256, inode and mtime of every file of the run's finished iterations and their checkpoints."""
    files = []
    for k in RunPaths(run_dir).completed_iterations():
        for root in (run_dir / f"iter_{k}", run_dir / "checkpoints" / f"step_{k}"):
            # hidden names are files being written (utils.atomic_write_bytes): not outputs yet
            files += [p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")]
    return {str(p.relative_to(run_dir)): (sha256_file(p), p.stat().st_ino, p.stat().st_mtime_ns) for p in files}


def iteration_2_outputs(run_dir: Path) -> str:
    """Which of iteration 2's outputs existed (where a kill landed)."""
    outputs = {"rollout": "iter_2/rollout/manifest.json", "batch": "iter_2/batch/manifest.json",
               "update": "iter_2/update.json", "checkpoint": "checkpoints/step_2/checksums.json",
               "eval": "iter_2/eval.json", "metrics": "iter_2/metrics.json"}
    done = [name for name, rel in outputs.items() if (run_dir / rel).exists()]
    return "iter 2 had " + ("+".join(done) if done else "nothing")


# ----- the sweep ---------------------------------------------------------------------------------------------
class Sweep:
    def __init__(self, work: Path):
        self.work = work
        # the servers the sweep starts demand the run's token, as a run's do, and its requests carry it: one is
        # made where none is given (every process the sweep starts inherits it)
        auth.ensure_run_token()
        # PYTHONFAULTHANDLER: a run that does not end in time is sent SIGABRT first (`finish`), which writes every
        # thread's stack to its log: where it hung
        self.env = {**os.environ, "PREFECT_HOME": str(work / "prefect-home"), "PYTHONFAULTHANDLER": "1"}
        self.env.pop("PREFECT_API_URL", None)
        self.logs = work / "logs"
        self.logs.mkdir(parents=True)
        from areal_pipeline.model import build_tiny_model

        self.model = build_tiny_model(work / "tiny-model", seed=1)
        self._reference: Optional[Path] = None
        self._inference: Optional[ServerProcess] = None
        self._retrieval: Optional[ServerProcess] = None
        self.launched: list[int] = []  # pids of every command started, to check nothing of theirs is left

    # ---- commands ----
    def command(self, name: str, *args: str) -> tuple[subprocess.Popen, Path]:
        log = self.logs / f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', name)}.log"
        with open(log, "ab") as out:
            popen = subprocess.Popen([sys.executable, "-m", "cli", *args], cwd=REPO, env=self.env,
                                     stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        self.launched.append(popen.pid)
        return popen, log

    def train(self, name: str, output_dir: Path, *extra: str) -> tuple[subprocess.Popen, Path]:
        return self.command(name, "train", "--config", "configs/tiny_cpu.yaml", f"output_dir={output_dir}",
                            f"run_id={RUN_ID}", f"model.path={self.model}", *SMALL, *extra)

    def finish(self, popen: subprocess.Popen, log: Path, timeout: float = RUN_TIMEOUT_S) -> tuple[int, str]:
        """The command's exit code and log once it has ended; one still running after `timeout` is sent SIGABRT
        (its threads' stacks go to the log, see `__init__`), then its process group SIGKILL."""
        try:
            popen.wait(timeout)
        except subprocess.TimeoutExpired:
            popen.send_signal(signal.SIGABRT)
            # not reaped until its group is killed: the group's id stays its own, not another process's
            deadline = time.monotonic() + STACKS_WRITTEN_WITHIN_S
            while time.monotonic() < deadline and psutil.Process(popen.pid).status() != psutil.STATUS_ZOMBIE:
                time.sleep(0.1)
            with contextlib.suppress(ProcessLookupError):  # the group ended with it
                os.killpg(popen.pid, signal.SIGKILL)
            popen.wait()
        return popen.returncode, log.read_text(errors="replace")

    def reference(self) -> Path:
        """The final weights of a run that never failed (made once)."""
        if self._reference is None:
            out = self.work / "reference"
            code, text = self.finish(*self.train("reference", out))
            if code != 0:
                raise RuntimeError(f"the reference run failed: {last_line(text)}")
            self._reference = out / RUN_ID
        return self._reference

    def same_weights(self, run_dir: Path) -> bool:
        mine, theirs = run_dir / FINAL_WEIGHTS, self.reference() / FINAL_WEIGHTS
        return mine.is_file() and sha256_file(mine) == sha256_file(theirs)

    # ---- judging a run after a fault ----
    def rerun(self, name: str, run_dir: Path, notes: list[str], ignore: frozenset[str] = frozenset()
              ) -> tuple[Outcome, int, str]:
        """Rerun the same run id to the end: (outcome, exit status, output)."""
        before = {rel: state for rel, state in finished_files(run_dir).items() if rel not in ignore}
        done = RunPaths(run_dir).completed_iterations()
        popen, log = self.train(f"{name}-rerun", run_dir.parent)
        code, text = self.finish(popen, log)
        left = gone_within(popen.pid, 10)
        return self.judge_run(run_dir, code, text, left, notes, before, done, "rerun"), code, text

    def judge_run(self, run_dir: Path, code: int, text: str, left: list[str], notes: list[str],
                  before: dict, done: list[int], label: str) -> Outcome:
        """Survived: the run (`label`) completed with the reference's final weights and left nothing behind.
        Data lost: a file in `before` (the finished iterations' files) missing, changed or rewritten, or a rerun
        that did not continue after the iterations `done` before it."""
        kept = {p.name for p in (self.reference() / "checkpoints").iterdir()}  # older ones are pruned by design
        lost, rewritten = [], []
        for rel, (sha, inode, mtime) in before.items():
            path = run_dir / rel
            if not path.is_file():
                if not (rel.startswith("checkpoints/") and rel.split("/")[1] not in kept):
                    lost.append(rel)
            elif sha256_file(path) != sha:
                lost.append(rel)
            elif (path.stat().st_ino, path.stat().st_mtime_ns) != (inode, mtime):
                rewritten.append(rel)
        continued = re.search(r"iterations 1\.\.(\d+) are finished; continuing at (\d+)", text)
        if done and (continued is None or int(continued.group(2)) <= max(done)):
            rewritten.append(f"iterations {done} (the rerun started at {continued.group(2) if continued else 1})")
        if lost:
            notes.append(f"lost {', '.join(lost)}")
        if rewritten:
            notes.append(f"redid {', '.join(rewritten)}")
        if left:
            notes.append(f"left behind: {'; '.join(left)}")
        same = code == 0 and self.same_weights(run_dir)
        if code != 0:
            notes.append(f"{label} exit {code}: {short(last_line(text))}")
        else:
            notes.append(f"{label} done, final weights " + ("bitwise equal" if same else "DIFFER from the reference"))
        return Outcome(same and not left, "; ".join(notes), data_lost=bool(lost or rewritten))

    # ---- kills ----
    def start_and_wait_for(self, name: str, triggers: tuple[str, ...]) -> tuple[subprocess.Popen, Path, Path, str]:
        """A fresh run, once the first of `triggers` (globs under its run dir) exists: (run, log, run dir, what
        fired). Polled every 10 ms: what is killed on it is the node that starts after that output."""
        out = self.work / name
        popen, log = self.train(name, out)
        run_dir = out / RUN_ID

        def fired():
            return next((t for t in triggers if any(run_dir.glob(t))), None) or popen.poll() is not None

        what = wait_until(fired, RUN_TIMEOUT_S, interval=0.01)
        if not isinstance(what, str):  # the run ended first, or the trigger never appeared
            if popen.poll() is None:
                popen.kill()
            code, text = self.finish(popen, log)
            raise RuntimeError(f"the run ended (exit {code}) before {triggers[0]} appeared: {last_line(text)}")
        return popen, log, run_dir, what

    def kill_run(self, name: str, triggers: tuple[str, ...], keep_state_as: Optional[str] = None) -> Outcome:
        popen, log, run_dir, what = self.start_and_wait_for(name, triggers)
        popen.kill()
        popen.wait()
        left = gone_within(popen.pid, 30)  # the trainer may finish the command it was running first
        notes = [f"killed after {what}: {iteration_2_outputs(run_dir)}"]
        if left:
            notes.append(f"the killed run left {'; '.join(left)}")
        if keep_state_as is not None:
            shutil.copytree(run_dir, self.work / keep_state_as / RUN_ID, symlinks=True)
        outcome = self.rerun(name, run_dir, notes)[0]
        outcome.survived = outcome.survived and not left
        return outcome

    def kill_service(self, name: str, trigger: str, which: str) -> Outcome:
        """kill -9 the run's inference server or trainer rank; the run should recover by itself (node retries)."""
        popen, log, run_dir, what = self.start_and_wait_for(name, (trigger,))
        # the module a service runs, not a mention: the forkserver's command line names the modules it preloads
        wanted = {"inference server": "areal_pipeline.inference.server",
                  "trainer rank": "areal_pipeline.training.trainer_server"}[which]
        victims = []
        for proc in processes_of(popen.pid):
            try:
                if module_of(proc.cmdline()) == wanted:
                    proc.kill()
                    victims.append(proc)
            except psutil.NoSuchProcess:
                pass
        notes = [f"killed {which} pid {','.join(str(p.pid) for p in victims) or 'NONE FOUND'} after {what}: "
                 f"{iteration_2_outputs(run_dir)}"]
        before = finished_files(run_dir)
        code, text = self.finish(popen, log)
        if code == 0:
            notes.append("the run recovered by itself")
            outcome = self.judge_run(run_dir, code, text, gone_within(popen.pid, 10), notes, before, [], "run")
        else:
            notes.append(f"the run failed ({short(last_line(text), 100)})")
            gone_within(popen.pid, 30)
            outcome = self.rerun(name, run_dir, notes)[0]
        outcome.survived = outcome.survived and bool(victims)
        return outcome

    def stop_signal(self, name: str, trigger: str, signum: signal.Signals) -> Outcome:
        popen, log, run_dir, what = self.start_and_wait_for(name, (trigger,))
        sent = time.monotonic()
        os.killpg(popen.pid, signum)
        code, text = self.finish(popen, log, timeout=60)
        took = time.monotonic() - sent
        left = gone_within(popen.pid, 5)
        said = f"interrupted by {signum.name}" in text
        notes = [f"{signum.name} after {what} ({iteration_2_outputs(run_dir)}): exit {code} in {took:.1f}s"
                 + ("" if said else f", no 'interrupted by' message (last line: {short(last_line(text), 80)})")]
        if left:
            notes.append(f"left behind: {'; '.join(left)}")
        outcome = self.rerun(name, run_dir, notes)[0]
        outcome.survived = (outcome.survived and not left and said and code == 128 + signum
                            and took < STOPPED_WITHIN_S)
        return outcome

    # ---- corruptions ----
    def killed_after_batch(self) -> Path:
        """A copy of the run dir of a run killed -9 as iteration 2's batch appeared (made by that kill fault, or
        here): iteration 1 finished (checkpoint step_1), iteration 2's rollout and batch written, no update."""
        state = self.work / "killed-after-batch" / RUN_ID
        if not state.is_dir():
            popen, log, run_dir, _ = self.start_and_wait_for("corruption-base", ("iter_2/batch/manifest.json",))
            popen.kill()
            popen.wait()
            gone_within(popen.pid, 30)
            shutil.copytree(run_dir, state, symlinks=True)
        return state

    def corrupt_and_rerun(self, name: str, target: str, damage: Callable[[Path], None]) -> Outcome:
        """Damage `target` (a glob under the run dir) in a copy of the killed run's state, then rerun it."""
        run_dir = self.work / name / RUN_ID
        shutil.copytree(self.killed_after_batch(), run_dir, symlinks=True)
        matches = sorted(run_dir.glob(target))
        if not matches:
            return Outcome(False, f"sweep error: no {target} in the killed run's state")
        path = matches[0]
        target = str(path.relative_to(run_dir))
        damage(path)
        deleted = not path.exists()
        outcome, code, text = self.rerun(name, run_dir, [], ignore=frozenset({target}))
        named = [line for line in text.splitlines() if target in line]
        if outcome.data_lost:
            return outcome
        if code != 0:  # refused: clear only if the last line names the file
            clear = target in last_line(text)
            return Outcome(clear, f"refused: {short(last_line(text))}", unclear=not clear)
        if not outcome.survived:  # completed, but not to the reference's weights: the corrupt file was used
            return outcome
        replayed = re.search(r"replaying updates (\d+\.\.\d+)", text)
        if replayed:
            outcome.note = f"replayed updates {replayed.group(1)}; {outcome.note}"
        if named:
            return Outcome(True, f"named ({short(named[0][named[0].find(target):], 100)}); {outcome.note}")
        if deleted:  # nothing left to name: the output was computed again
            return Outcome(True, f"computed again; {outcome.note}")
        return Outcome(False, f"{target} never named: {outcome.note}")

    def corrupt_and_evaluate(self, name: str, target: str, damage: Callable[[Path], None]) -> Outcome:
        checkpoint = self.work / name / "step_3"
        shutil.copytree(self.reference() / "checkpoints" / f"step_{ITERATIONS}", checkpoint)
        damage(checkpoint / target)
        popen, log = self.command(name, "evaluate", "--config", "configs/tiny_cpu.yaml", "--checkpoint",
                                  str(checkpoint), f"output_dir={self.work / name}", f"run_id={RUN_ID}",
                                  f"model.path={self.model}", "eval_max_prompts=8")
        code, text = self.finish(popen, log)
        left = gone_within(popen.pid, 10)
        line = last_line(text)
        named = target in line
        note = f"exit {code}: {short(line)}" + (f"; left behind: {'; '.join(left)}" if left else "")
        return Outcome(code != 0 and named and not left, note, unclear=code != 0 and not named)

    # ---- bad values ----
    def bad_value(self, name: str, overrides: list[str], expected: str, config: str = "configs/tiny_cpu.yaml"
                  ) -> Outcome:
        """`train` with the fault's overrides last (they win over the sweep's small settings)."""
        out = self.work / name
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.monotonic()
        popen, log = self.command(name, "train", "--config", config, f"output_dir={out}", f"model.path={self.model}",
                                  *SMALL, *overrides)
        code, text = self.finish(popen, log, timeout=120)
        wall = time.monotonic() - started
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime + after.ru_stime) - (usage.ru_utime + usage.ru_stime)
        left = gone_within(popen.pid, 10)
        line = last_line(text)
        named = expected in line
        note = f"exit {code} in {wall:.1f}s ({cpu:.1f}s CPU): {short(line)}"
        if left:
            note += f"; left behind: {'; '.join(left)}"
        if out.exists() and any(out.iterdir()):
            note += "; it wrote " + ", ".join(sorted(p.name for p in out.iterdir()))
        wrote = out.exists() and any(out.iterdir())
        quick = cpu < REJECTED_WITHIN_S and wall < REJECTED_WALL_S and not wrote
        return Outcome(code != 0 and named and quick and not left, note, unclear=code != 0 and not named)

    def file(self, name: str, text: str) -> Path:
        path = self.work / "files" / name
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
        return path

    # ---- servers ----
    def inference(self) -> str:
        if self._inference is None:
            port = find_free_port()
            self._inference = ServerProcess(
                [sys.executable, "-m", "areal_pipeline.inference.server", "--model", str(self.model), "--host",
                 "127.0.0.1", "--port", str(port), "--seed", "0", "--weights-root", str(self.work / "weights")],
                f"127.0.0.1:{port}",
                self.logs / "inference-server.log").start()
            self._inference.wait_healthy(180)
        return self._inference.address

    def retrieval(self) -> str:
        if self._retrieval is None:
            from areal_pipeline.data.knowledge_base import knowledge_base

            corpus = self.file("corpus.jsonl", "".join(json.dumps(r) + "\n" for r in knowledge_base().corpus))
            port = find_free_port()
            self._retrieval = ServerProcess(
                [sys.executable, "-m", "cli", "retrieval-server", "--corpus", str(corpus),
                 "--host", "127.0.0.1", "--port", str(port), "--index-dir", str(self.work / "indexes")],
                f"127.0.0.1:{port}", self.logs / "retrieval-server.log", env=self.env).start()
            self._retrieval.wait_healthy(180)
        return self._retrieval.address

    def stop_servers(self) -> None:
        for server in (self._inference, self._retrieval):
            if server is not None:
                server.stop()

    def link_out(self, name: str, target: Path) -> Path:
        """A symlink inside the run's weights directory (`name/out`) pointing at `target`, outside it."""
        link = self.work / "weights" / name / "out"
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.is_symlink():
            link.symlink_to(target)
        return link

    def weights_dir(self, name: str, change: Callable[[dict], dict], cut: bool = False) -> Path:
        """A model directory whose weights are the tiny model's, changed by `change` (cut: file truncated)."""
        from safetensors.torch import load_file, save_file

        directory = self.work / "weights" / name
        directory.mkdir(parents=True)
        save_file(change(load_file(str(self.model / "model.safetensors"))), str(directory / "model.safetensors"))
        if cut:
            truncate(directory / "model.safetensors")
        return directory


# ----- hostile requests --------------------------------------------------------------------------------------
def post(address: str, path: str, data: Optional[bytes], content_type: Optional[str] = "application/json",
         timeout: float = 120, authorization: Optional[str] = None) -> tuple[int, object]:
    """(status, reply as JSON or text) of one request; an HTTP error is a reply, a broken connection status 0.
    `authorization`: the header sent instead of the run's credential ("": none)."""
    headers = {} if content_type is None else {"Content-Type": content_type}
    req = auth.request(address, path, data=data, headers=headers, method="GET" if data is None else "POST")
    if authorization is not None:
        req.remove_header("Authorization")
        if authorization:
            req.add_header("Authorization", authorization)
    try:
        with auth.opener().open(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    except OSError as e:
        return 0, f"{type(e).__name__}: {e}"
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def message_of(reply: object) -> str:
    if isinstance(reply, dict):
        error = reply.get("error")
        if isinstance(error, dict):
            return str(error.get("message", ""))
        return str(reply.get("message") or error or "")
    return str(reply)


def while_polling_health(address: str, call: Callable[[], tuple[int, object]]):
    """(status, reply, seconds, the /health answer times meanwhile; inf for one that failed)."""
    latencies: list[float] = []
    done = threading.Event()

    def poll():
        while not done.is_set():
            started = time.perf_counter()
            ok = post(address, "/health", None, None, timeout=30)[0] == 200
            latencies.append(time.perf_counter() - started if ok else math.inf)
            time.sleep(0.05)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    time.sleep(0.1)  # /health is being polled when the request goes out
    started = time.perf_counter()
    try:
        status, reply = call()
    finally:
        took = time.perf_counter() - started
        done.set()
        poller.join()
    return status, reply, took, latencies


def normal_request(server: str, address: str) -> bool:
    if server == "inference":
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
        return post(address, "/generate", json.dumps(body).encode())[0] == 200
    return post(address, "/retrieve", json.dumps({"queries": ["capital"], "topk": 1}).encode())[0] == 200


def request_fault(server: str, path: str, body: Callable[["Sweep"], Optional[bytes]], expected: set[int],
                  content_type: Optional[str] = "application/json", fragment: str = "",
                  authorization: Optional[str] = None) -> Callable[["Sweep"], Outcome]:
    """A request judged by its status (in `expected`), a message (containing `fragment`), the time to answer,
    /health meanwhile and a normal request afterwards. `authorization`: sent instead of the run's credential."""
    def inject(sweep: Sweep) -> Outcome:
        address = sweep.inference() if server == "inference" else sweep.retrieval()
        data = body(sweep)
        version = post(address, "/get_model_info", None)[1] if server == "inference" else None
        status, reply, took, health = while_polling_health(
            address, lambda: post(address, path, data, content_type, authorization=authorization))
        slowest = max(health, default=math.inf)
        message = message_of(reply) if status != 200 else f"{len(reply) if isinstance(reply, dict) else 0} fields"
        still = normal_request(server, address)
        unchanged = server != "inference" or post(address, "/get_model_info", None)[1] == version
        size = "" if data is None else f"{len(data) / 1e6:.1f} MB: " if len(data) > 1e6 else ""
        note = (f"{size}{status} in {took:.2f}s, /health x{len(health)} <= {slowest:.2f}s: {short(message, 90)}"
                + ("" if still else "; a normal request then FAILED")
                + ("" if unchanged else "; the served weights CHANGED"))
        has_message = status == 200 or (bool(message.strip()) and fragment in message)
        ok = (status in expected and has_message and took < ANSWERED_WITHIN_S and slowest < HEALTH_WITHIN_S
              and still and unchanged)
        return Outcome(ok, note, unclear=status >= 400 and not message.strip())
    return inject


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def faults() -> list[Fault]:
    kill, stop, kill_service = Sweep.kill_run, Sweep.stop_signal, Sweep.kill_service
    corrupt, evaluate = Sweep.corrupt_and_rerun, Sweep.corrupt_and_evaluate

    def bad(name: str, overrides: list[str], expected: str, quick: bool = False) -> Fault:
        slug = re.sub(r"\W+", "_", name)
        return Fault(f"bad value: {name}", "bad value", lambda s: s.bad_value(slug, overrides, expected), quick)

    def bad_file(name: str, filename: str, text: Optional[str], overrides: Callable[[Path], list[str]],
                 quick: bool = False, config: bool = False) -> Fault:
        """A bad file (`text` None: a missing one), to be named by its path; `config`: given as --config."""
        def inject(s: Sweep) -> Outcome:
            path = s.file(filename, text) if text is not None else s.work / "files" / filename
            slug = re.sub(r"\W+", "_", name)
            if config:
                return s.bad_value(slug, [], str(path), config=str(path))
            return s.bad_value(slug, overrides(path), str(path))
        return Fault(f"bad value: {name}", "bad value", inject, quick)

    def request(name: str, server: str, path: str, body, expected: set[int], quick: bool = False, **kw) -> Fault:
        return Fault(f"{server}: {name}", "request", request_fault(server, path, body, expected, **kw), quick)

    def nan_last(state: dict) -> dict:
        last = sorted(state)[-1]
        return {**state, last: state[last] * float("nan")}

    generate = {"input_ids": [1], "sampling_params": {"temperature": float("nan")}}
    return [
        bad("rollout.batch_size=0", ["rollout.batch_size=0"], "rollout.batch_size", quick=True),
        bad("rollout.gconfig.n_samples=0", ["rollout.gconfig.n_samples=0"], "rollout.gconfig.n_samples"),
        bad("trainer.optimizer.lr=-1", ["trainer.optimizer.lr=-1"], "trainer.optimizer.lr"),
        bad("rollout.gconfig.temperature=nan", ["rollout.gconfig.temperature=nan"], "rollout.gconfig.temperature",
            quick=True),
        bad("model.path=/nonexistent/dir", ["model.path=/nonexistent/dir"], "/nonexistent/dir"),
        bad("unknown key rollout.gconfig.n_sample", ["rollout.gconfig.n_sample=4"], "rollout.gconfig.n_sample",
            quick=True),
        bad_file("empty dataset file", "empty.jsonl", "", lambda f: ["dataset.name=gsm8k", f"dataset.path={f}"],
                 quick=True),
        bad_file("malformed dataset row", "malformed.jsonl",
                 '{"question": "1+1?", "answer": "#### 2"}\n{"question": "2+2?", "answer": \n',
                 lambda f: ["dataset.name=gsm8k", f"dataset.path={f}"]),
        bad_file("missing config file", "no-such.yaml", None, lambda f: [], config=True),
        bad_file("config with a YAML syntax error", "broken.yaml", "rollout: [1, 2\n", lambda f: [], config=True),

        request("100 MB body", "inference", "/generate",
                lambda s: b'{"input_ids": [' + b"1000, " * (100_000_000 // 6) + b"1]}", {413}, quick=True),
        request("40 MB prompt", "inference", "/generate", lambda s: json.dumps(
            {"text": "ab " * 13_400_000, "sampling_params": {"max_new_tokens": 8}}).encode(), {400}),
        request("NaN temperature", "inference", "/generate", lambda s: json.dumps(generate).encode(), {400},
                quick=True, fragment="temperature"),
        request("body not JSON", "inference", "/generate", lambda s: b"{not json", {415}),
        request("JSON nested 100,000 deep", "inference", "/generate", lambda s: nested(100_000), {400}),
        request("update weights from a truncated file", "inference", "/update_weights_from_disk",
                lambda s: json.dumps({"model_path": str(s.weights_dir("truncated", dict, cut=True))}).encode(),
                {400}),
        request("update weights holding NaN", "inference", "/update_weights_from_disk",
                lambda s: json.dumps({"model_path": str(s.weights_dir("nan", nan_last))}).encode(), {400},
                fragment="NaN"),
        request("update weights from outside the run", "inference", "/update_weights_from_disk",
                lambda s: json.dumps({"model_path": str(s.model)}).encode(), {403}, fragment="--weights-root"),
        request("update weights through a symlink out of the run", "inference", "/update_weights_from_disk",
                lambda s: json.dumps({"model_path": str(s.link_out("weights", s.model))}).encode(), {403}),
        request("generate without the credential", "inference", "/generate", lambda s: json.dumps(
            {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}).encode(), {401}, authorization="",
                quick=True, fragment="credential"),
        request("weights without the credential", "inference", "/get_weights_by_name",
                lambda s: json.dumps({"name": "lm_head.weight"}).encode(), {401}, authorization="Bearer guess",
                fragment="credential"),
        request("update weights without the credential", "inference", "/update_weights_from_disk",
                lambda s: json.dumps({"model_path": str(s.weights_dir("unasked", dict))}).encode(), {401},
                authorization="", fragment="credential"),
        request("/get_server_info", "inference", "/get_server_info", lambda s: None, {200}),
        request("50,000 queries", "retrieval", "/retrieve",
                lambda s: json.dumps({"queries": ["capital"] * 50_000, "topk": 3}).encode(), {413}, quick=True),
        request("2 MB body", "retrieval", "/retrieve",
                lambda s: json.dumps({"queries": ["capital of " * 200_000]}).encode(), {413}),
        request("body not JSON", "retrieval", "/retrieve", lambda s: b'{"queries": ["capital"]', {415}),
        request("retrieve with a wrong credential", "retrieval", "/retrieve",
                lambda s: json.dumps({"queries": ["capital"]}).encode(), {401}, authorization="Basic x",
                fragment="credential"),
        request("JSON nested 50,000 deep", "retrieval", "/retrieve", lambda s: nested(50_000), {400}),
        request("queries of the wrong type", "retrieval", "/retrieve",
                lambda s: json.dumps({"queries": [["capital"]]}).encode(), {400}, fragment="queries"),

        # the kill lands on the node that starts once the named output appears
        Fault("kill -9 run as rollout 2 starts", "kill", lambda s: kill(s, "kill-rollout", ("iter_1/eval.json",))),
        Fault("kill -9 run as advantages 2 start", "kill",
              lambda s: kill(s, "kill-advantages", ("iter_2/rollout/manifest.json",))),
        Fault("kill -9 run as ppo_update 2 starts", "kill",
              lambda s: kill(s, "kill-update", ("iter_2/batch/manifest.json",), keep_state_as="killed-after-batch"),
              quick=True),
        Fault("kill -9 run as broadcast 2 starts", "kill",
              lambda s: kill(s, "kill-broadcast", ("iter_2/update.json",))),
        Fault("kill -9 run mid checkpoint 2 save", "kill", lambda s: kill(
            s, "kill-checkpoint", ("checkpoints/.step_2.tmp-*", "checkpoints/step_2/checksums.json"))),
        Fault("kill -9 run as evaluate 2 starts", "kill",
              lambda s: kill(s, "kill-evaluate", ("checkpoints/step_2/checksums.json",))),
        Fault("kill -9 inference server in iter 2", "kill",
              lambda s: kill_service(s, "kill-server", "iter_1/eval.json", "inference server")),
        Fault("kill -9 trainer rank in iter 2", "kill",
              lambda s: kill_service(s, "kill-trainer", "iter_2/batch/manifest.json", "trainer rank")),
        Fault("SIGINT to the run's group (Ctrl-C)", "kill",
              lambda s: stop(s, "sigint-group", "iter_2/rollout/manifest.json", signal.SIGINT)),
        Fault("SIGTERM to the run's group", "kill",
              lambda s: stop(s, "sigterm-group", "iter_2/update.json", signal.SIGTERM)),

        # in the state of a run killed as iteration 2's batch appeared
        Fault("flipped byte: rollout shard of iter 2", "corrupt",
              lambda s: corrupt(s, "flip-rollout", "iter_2/rollout/part-*.parquet", flip_byte)),
        Fault("truncated: rollout shard of iter 2", "corrupt",
              lambda s: corrupt(s, "cut-rollout", "iter_2/rollout/part-*.parquet", truncate)),
        Fault("flipped byte: batch shard of iter 2", "corrupt",
              lambda s: corrupt(s, "flip-batch", "iter_2/batch/part-*.parquet", flip_byte)),
        Fault("truncated: batch shard of iter 2", "corrupt",
              lambda s: corrupt(s, "cut-batch", "iter_2/batch/part-*.parquet", truncate), quick=True),
        Fault("flipped byte: step_1 model.safetensors", "corrupt",
              lambda s: corrupt(s, "flip-model", "checkpoints/step_1/model/model.safetensors", flip_byte)),
        Fault("truncated: step_1 optimizer.safetensors", "corrupt",
              lambda s: corrupt(s, "cut-optimizer", "checkpoints/step_1/optimizer.safetensors", truncate)),
        Fault("deleted: batch manifest.json of iter 2", "corrupt",
              lambda s: corrupt(s, "no-batch-manifest", "iter_2/batch/manifest.json", Path.unlink)),
        Fault("deleted: step_1 checksums.json", "corrupt",
              lambda s: corrupt(s, "no-checksums", "checkpoints/step_1/checksums.json", Path.unlink)),
        Fault("evaluate: flipped byte in model.safetensors", "corrupt",
              lambda s: evaluate(s, "evaluate-flipped", "model/model.safetensors", flip_byte)),
        Fault("evaluate: truncated model.safetensors", "corrupt",
              lambda s: evaluate(s, "evaluate-truncated", "model/model.safetensors", truncate)),
    ]


def print_table(rows: list[Row]) -> None:
    width = max(len(r.fault.name) for r in rows)
    print(f"\n{'fault':<{width}}  {'category':<9}  {'outcome':<9}  {'seconds':>7}  note")
    for r in rows:
        print(f"{r.fault.name:<{width}}  {r.fault.category:<9}  {r.verdict:<9}  {r.seconds:>7.1f}  {r.outcome.note}")
    print(flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one kill, one corruption, a few bad values and requests")
    p.add_argument("--only", nargs="+", default=None, help="only the faults whose name contains one of these")
    p.add_argument("--keep", action="store_true", help="keep the work directory (kept anyway when a fault fails)")
    args = p.parse_args()

    chosen = [f for f in faults() if (f.quick or not args.quick)
              and (args.only is None or any(s.lower() in f.name.lower() for s in args.only))]
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="bench-faults-"))
    print(f"{len(chosen)} faults; work directory {work}", flush=True)
    sweep = Sweep(work)
    rows: list[Row] = []
    try:
        if any(f.category in ("kill", "corrupt") for f in chosen):
            t0 = time.monotonic()
            sweep.reference()
            print(f"reference run (never fails): {time.monotonic() - t0:.0f}s", flush=True)
        for fault in chosen:
            t0 = time.monotonic()
            try:
                outcome = fault.inject(sweep)
            except Exception as error:  # the sweep's own trouble (a run that never reached the fault, ...)
                outcome = Outcome(False, f"sweep error: {type(error).__name__}: {short(str(error), 200)}")
            rows.append(Row(fault, outcome, time.monotonic() - t0))
            print(f"[{time.monotonic() - started:6.0f}s] {rows[-1].verdict:<9} {fault.name}: {outcome.note}",
                  flush=True)
    finally:
        sweep.stop_servers()
    left = [pid for pid in sweep.launched if processes_of(pid)]
    total = time.monotonic() - started

    print_table(rows)
    failed = [r for r in rows if r.verdict != "survived"]
    if left:
        print(f"processes of {left} still running at the end", flush=True)
    if failed or left or args.keep:
        print(f"logs and runs kept in {work}", flush=True)
    else:
        shutil.rmtree(work, ignore_errors=True)
    by_category: dict[str, list[int]] = {}
    for r in rows:
        tried_survived = by_category.setdefault(r.fault.category, [0, 0])
        tried_survived[0] += 1
        tried_survived[1] += r.verdict == "survived"
    figures = {
        "faults_tried": len(rows),
        "survived": sum(r.verdict == "survived" for r in rows),
        "data_lost": sum(r.outcome.data_lost for r in rows),
        "unclear_errors": sum(r.outcome.unclear for r in rows),
        "not_survived": [r.fault.name for r in failed],
        "tried_survived_by_category": by_category,
        "processes_left": len(left),
        "quick": args.quick,
        "seconds": round(total, 1),
    }
    print(json.dumps(figures))
    sys.exit(1 if figures["data_lost"] or figures["unclear_errors"] else 0)


if __name__ == "__main__":
    main()

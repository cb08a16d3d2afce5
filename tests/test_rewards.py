import asyncio
import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _reward_helpers import fail, hang, hang_after_writing_pid, hang_or_fail_on_marker
from conftest import data_dirs

from areal_pipeline.rewards import RewardPool, extract_answer, extract_reference, math_reward
from areal_pipeline.rewards.pool import RewardCrash, RewardError, RewardTimeout

TIMEOUT = 2.0


@pytest.fixture(scope="module", params=data_dirs("gsm8k"))
def gsm8k_rows(request):
    with (request.param / "test.jsonl").open() as f:
        rows = [json.loads(line) for line in itertools.islice(f, 200)]
    assert len(rows) >= 48, request.param
    return rows


def test_gsm8k_reference_solution_scores_itself(gsm8k_rows):
    for row in gsm8k_rows:
        assert math_reward(row["answer"], row["answer"]) == 1.0, row["answer"]


def test_gsm8k_answer_is(gsm8k_rows):
    for row in gsm8k_rows:
        n = int(extract_reference(row["answer"]).replace(",", ""))
        assert math_reward(f"Step by step... The answer is {n}.", row["answer"]) == 1.0
        assert math_reward(f"Step by step... The answer is {n + 1}.", row["answer"]) == 0.0


@pytest.mark.parametrize(
    "completion, reference, expected",
    [
        ("So the total is \\boxed{72}.", "72", 1.0),
        ("So the total is \\boxed{71}.", "72", 0.0),
        ("\\boxed{\\boxed{5}}", "5", 1.0),
        ("\\boxed{\\frac{3}{4}}", "\\frac{3}{4}", 1.0),
        ("First \\boxed{3}, on second thought \\boxed{4}", "4", 1.0),
        ("First \\boxed{3}, on second thought \\boxed{4}", "3", 0.0),
        ("\\boxed{4} and then the output got cut \\boxed{3", "4", 1.0),
        ("Boxed beats the rest: the answer is 5, \\boxed{6}", "6", 1.0),
        ("16 - 3 - 4 = 9 eggs.\n#### 18", "#### 18", 1.0),
        ("#### 18\nwith 20 eggs left", "18", 1.0),
        ("The answer is 18.", "Janet makes 9 * 2 = $18.\n#### 18", 1.0),
        ("THE ANSWER IS: 18", "18", 1.0),
        ("The final answer is 18 dollars.", "18", 1.0),
        ("She has 3 cats and 5 dogs, so 8 pets.", "8", 1.0),
        ("She has 3 cats and 5 dogs, so 8 pets.", "5", 0.0),
        ("The answer is 1,000.", "1000", 1.0),
        ("The answer is 1000", "1,000", 1.0),
        ("The answer is $1,000.", "1000", 1.0),
        ("The answer is \\$18", "18", 1.0),
        ("The answer is 5 apples.", "5", 1.0),
        ("The answer is \\text{5 apples}", "5", 1.0),
        ("The answer is 3/4", "0.75", 1.0),
        ("The answer is 0.75", "3/4", 1.0),
        ("The answer is 3/5", "0.75", 0.0),
        ("The answer is \\frac{1}{2}", "0.5", 1.0),
        ("The answer is \\dfrac{1}{2}.", "0.5", 1.0),
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", 1.0),
        ("The answer is 50%", "50", 1.0),
        ("The answer is 50\\%", "0.5", 1.0),
        ("The answer is 50%", "5", 0.0),
        ("The temperature dropped to -7 degrees.", "-7", 1.0),
        ("The answer is -7", "7", 0.0),
        ("10-5 = 5", "5", 1.0),
        ("The answer is 2.50", "2.5", 1.0),
        ("It costs 2.5 dollars", "2.50", 1.0),
        ("I do not know.", "5", 0.0),
        ("", "5", 0.0),
    ],
)
def test_math_reward(completion, reference, expected):
    assert math_reward(completion, reference) == expected


@pytest.mark.parametrize(
    "text, answer",
    [
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{\\boxed{5}}", "5"),
        ("#### 1,000", "1,000"),
        ("The final answer is 18 dollars. Check: 9 * 2 = 18", "18 dollars"),
        ("The answer is 2.5.", "2.5"),
        ("x = 10-5 = 5 and y = -3", "-3"),
        ("no digits here", None),
    ],
)
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


@pytest.mark.parametrize(
    "reference, answer",
    [
        ("Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs.\n#### 18", "18"),
        ("so $\\boxed{\\frac{3}{4}}$", "\\frac{3}{4}"),
        (" 72 ", "72"),
    ],
)
def test_extract_reference(reference, answer):
    assert extract_reference(reference) == answer


@pytest.fixture(scope="module")
def pool():
    with RewardPool(max_workers=2, timeout=TIMEOUT) as pool:
        yield pool


def test_pool_scores(pool):
    assert pool.score(math_reward, "\\boxed{\\frac{3}{4}}", "0.75") == 1.0
    assert pool.score(math_reward, "The answer is 4", "#### 5") == 0.0


def test_pool_hanging_call_times_out_and_pool_recovers(pool):
    pool.score(math_reward, "1", "1")  # worker start-up is not part of the timeout
    start = time.monotonic()
    with pytest.raises(RewardTimeout, match=r"_reward_helpers.hang\('some completion', '#### 18'\) ran past 2 s"):
        pool.score(hang, "some completion", "#### 18")  # never a score of 0.0
    assert time.monotonic() - start < 40  # the timeout, not the call's 60 s
    assert pool.score(math_reward, "\\boxed{18}", "#### 18") == 1.0


def test_pool_raising_call_is_a_reward_error_with_truncated_args(pool):
    message = r"_reward_helpers.fail\('xxx.*\.\.\. raised ValueError\('bad reward"
    with pytest.raises(RewardError, match=message) as raised:
        pool.score(fail, "x" * 10_000)
    assert len(str(raised.value)) < 500
    assert not isinstance(raised.value, (RewardTimeout, RewardCrash))


def test_pool_ascore_many_concurrent_calls(pool):
    async def main():
        good = [pool.ascore(math_reward, f"The answer is {i}.", f"#### {i % 3}") for i in range(60)]
        return await asyncio.gather(pool.ascore(hang, "stuck"), *good, return_exceptions=True)

    stuck, *scores = asyncio.run(main())
    assert isinstance(stuck, RewardTimeout) and "'stuck'" in str(stuck)
    assert scores == [1.0 if i == i % 3 else 0.0 for i in range(60)]


def test_pool_ascore_many_scores_a_group_in_one_job_and_a_raising_call_fails_it(pool):
    with pytest.raises(RewardError, match=r"hang_or_fail_on_marker\('fail', '7'\) raised ValueError\('bad reward"):
        asyncio.run(pool.ascore_many(hang_or_fail_on_marker, [("7", "7"), ("fail", "7"), ("3", "7"), ("7", "7")]))
    assert asyncio.run(pool.ascore_many(hang_or_fail_on_marker, [("7", "7"), ("3", "7"), ("7", "7")])) == [1.0, 0.0,
                                                                                                          1.0]
    assert asyncio.run(pool.ascore_many(hang_or_fail_on_marker, [])) == []
    assert asyncio.run(pool.ascore_many(hang_or_fail_on_marker, [("5", "5")])) == [1.0]


def test_pool_ascore_many_with_a_hanging_call_rescores_one_by_one_and_names_it(pool, caplog):
    calls = [("1", "1"), ("hang", "1"), ("2", "1")]
    pool.score(math_reward, "1", "1")  # worker start-up is not part of the timeout
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="areal_pipeline.rewards"):
        with pytest.raises(RewardTimeout, match=r"hang_or_fail_on_marker\('hang', '1'\) ran past 2 s"):
            asyncio.run(pool.ascore_many(hang_or_fail_on_marker, calls))
    # the job's timeout (3 calls' worth), then the hanging call's own one
    assert time.monotonic() - start < 45  # the timeouts, not the hanging call's 60 s
    assert any("one by one" in r.message for r in caplog.records)
    assert pool.score(math_reward, "\\boxed{18}", "#### 18") == 1.0


def test_a_killed_worker_is_a_reward_crash_and_the_pool_goes_on(pool, tmp_path):
    """SIGKILL of the worker mid-score (the OOM killer's way): RewardCrash naming its pid, never 0.0; the next
    call runs on a fresh worker."""
    pid_file = tmp_path / "pid"

    async def main():
        scoring = asyncio.ensure_future(pool.ascore(hang_after_writing_pid, str(pid_file)))
        deadline = time.monotonic() + 30
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline, "the reward call never started"
            await asyncio.sleep(0.05)
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
        return await asyncio.gather(scoring, return_exceptions=True)

    [crash] = asyncio.run(main())
    assert isinstance(crash, RewardCrash), crash
    assert crash.peer == f"reward worker pid {pid_file.read_text()}" and "died scoring" in str(crash)
    assert pool.score(math_reward, "\\boxed{18}", "#### 18") == 1.0


def test_close_is_bounded_and_stops_a_busy_worker():
    pool = RewardPool(max_workers=1, timeout=60.0)
    future = pool._submit(hang, ("forever",))
    time.sleep(0.5)
    start = time.monotonic()
    pool.close(timeout=1.0)
    assert time.monotonic() - start < 40  # not the call's 60 s
    assert future.done()


def test_warm_up_starts_the_workers_with_the_reward_module_imported():
    with RewardPool(max_workers=2, timeout=TIMEOUT) as pool:
        futures = pool.warm_up(math_reward)
        assert [f.result(timeout=60) for f in futures] == ["areal_pipeline.rewards.math"] * 2
        assert pool.score(math_reward, "\\boxed{7}", "#### 7") == 1.0


def test_a_reward_reference_loads_in_the_workers_a_function_from_a_file(tmp_path):
    """A reward named "path/to/file.py:fn" scores in the pool's workers (the function itself, pickled by the name
    of a module loaded from a file, could not reach them), warm-up loads it there, and this process never does."""
    from areal_pipeline.rewards import RewardReference
    from areal_pipeline.rewards.pool import _LOADED

    source = tmp_path / "my_reward.py"
    source.write_text("def reward(completion, answer):\n    return 1.0 if completion.strip() == answer else 0.25\n")
    reference = RewardReference(f"{source}:reward")
    with RewardPool(max_workers=1, timeout=TIMEOUT) as pool:
        assert [f.result(timeout=60) for f in pool.warm_up(reference)] == [f"{source}:reward"]
        assert pool.score(reference, " 4 ", "4") == 1.0
        assert asyncio.run(pool.ascore_many(reference, [("4", "4"), ("5", "4")])) == [1.0, 0.25]
    assert f"{source}:reward" not in _LOADED


@pytest.mark.parametrize("reference, message", [
    ("areal_pipeline.rewards.math:no_such_reward", "has no 'no_such_reward'"),
    ("no_such_module_here:reward", "cannot import 'no_such_module_here'"),
])
def test_a_reward_reference_that_cannot_load_is_an_error_not_a_score_of_zero(reference, message):
    from areal_pipeline.rewards import RewardReference
    from areal_pipeline.rewards.pool import RewardLoadError

    ref = RewardReference(reference, "MyWorkflow.reward_function")
    with RewardPool(max_workers=1, timeout=TIMEOUT) as pool:
        with pytest.raises(RewardLoadError, match=message):
            pool.score(ref, "1", "1")
        with pytest.raises(RewardLoadError, match=message):
            asyncio.run(pool.ascore(ref, "1", "1"))
        with pytest.raises(RewardLoadError, match="MyWorkflow.reward_function"):
            asyncio.run(pool.ascore_many(ref, [("1", "1"), ("2", "2")]))


def test_the_orchestrating_process_does_not_import_the_math_reward():
    """What a run's orchestrating process does with the reward (build the workflow's reward reference, import the
    train flow) imports neither math-verify nor sympy: only the pool's workers do."""
    import subprocess
    import sys

    code = ("import sys\nfrom areal_pipeline.run_spec import load_run\nimport flows.train\n"
            "fn = load_run('configs/tiny_cpu.yaml', []).reward\n"
            "print(fn, sorted(m for m in ('math_verify', 'sympy', 'areal_pipeline.rewards.math') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "areal_pipeline.rewards.math:math_reward []"


_FORKED_WORKERS = r'''
import os, sys, time
import psutil
from areal_pipeline import forkserver
forkserver.start(["areal_pipeline.rewards.math"])  # as `train` starts the services' forkserver
from areal_pipeline.rewards.pool import RewardPool, RewardReference, RewardTimeout

with RewardPool(1, timeout=2.0) as pool:
    assert pool.score(RewardReference("areal_pipeline.rewards.math:math_reward"), "#### 42", "42") == 1.0
    assert pool.score(RewardReference("loud_reward:loud"), "x") == 1.0
    workers = [p for p in psutil.Process().children(recursive=True) if p.ppid() != os.getpid()]
    print("WORKERS", [(" ".join(p.parent().cmdline()), p.parent().ppid() == os.getpid()) for p in workers],
          flush=True)
    try:
        pool.score(RewardReference("loud_reward:hang"), "x")
        raise AssertionError("a hanging reward scored")
    except RewardTimeout:  # timed out: the worker is replaced
        pass
    assert pool.score(RewardReference("loud_reward:loud"), "y") == 1.0
print("DONE", flush=True)
'''


def test_reward_workers_are_forks_of_the_services_forkserver_with_the_commands_output(tmp_path):
    """Where the command runs a forkserver (`train` starts one), reward workers are its forks: no interpreter
    and no imports of their own. What a reward function prints reaches the command's stdout and stderr, as a
    spawned worker's did; a worker killed for a timeout is replaced by another fork."""
    (tmp_path / "loud_reward.py").write_text(
        "import sys, time\n"
        "def loud(x):\n    print('LOUD', x, flush=True)\n    print('ERR', x, file=sys.stderr, flush=True)\n"
        "    return 1.0\n"
        "def hang(x):\n    time.sleep(60)\n")
    done = subprocess.run([sys.executable, "-c", _FORKED_WORKERS], cwd=Path(__file__).resolve().parents[1],
                          env={**os.environ, "PYTHONPATH": str(tmp_path), "AREAL_FORKSERVER": "1"},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "DONE" in done.stdout, done.stdout + done.stderr
    workers = next(line for line in done.stdout.splitlines() if line.startswith("WORKERS"))
    assert "multiprocessing.forkserver" in workers and "True)" in workers and "False)" not in workers, workers
    assert "LOUD x" in done.stdout and "LOUD y" in done.stdout, done.stdout
    assert "ERR x" in done.stderr, done.stderr


def test_a_broken_worker_pool_is_replaced_and_scoring_goes_on():
    """pebble's pool refuses every call once it broke (a worker killed while a manager thread used its channel
    leaves it in that state; a stopped pool refuses the same way): the reward pool starts a new one."""
    with RewardPool(max_workers=1, timeout=TIMEOUT) as pool:
        assert pool.score(math_reward, "\\boxed{7}", "#### 7") == 1.0
        pool._pool.stop()
        pool._pool.join()
        assert pool.score(math_reward, "\\boxed{7}", "#### 7") == 1.0
        assert asyncio.run(pool.ascore_many(math_reward, [("\\boxed{7}", "#### 7"), ("8", "#### 7")])) == [1.0, 0.0]


_TRACKER_GONE = r'''
import operator, os, signal, time
import psutil
from multiprocessing import resource_tracker
from areal_pipeline.rewards import pool as pool_module
from areal_pipeline.rewards.pool import RewardPool

resource_tracker.ensure_running()
(tracker,) = [p for p in psutil.Process().children() if "multiprocessing.resource_tracker" in " ".join(p.cmdline())]
assert pool_module._resource_tracker_running()
pool = RewardPool(max_workers=1, timeout=30.0)
first, real_schedule = pool._pool, type(pool._pool).schedule


def schedule_in_the_race(self, *args, **kwargs):
    # what the standard library raises when the tracker ends between its check that the tracker runs and the
    # registration of the starting pool's first lock (a window of microseconds, not reproducible on demand)
    if self is first:
        raise BrokenPipeError(32, "Broken pipe")
    return real_schedule(self, *args, **kwargs)


type(first).schedule = schedule_in_the_race
try:
    pool.warm_up(operator.add)  # what `train` calls first, and where the pool starts
    raise AssertionError("a broken pipe to a running tracker was passed over")
except BrokenPipeError:
    print("RAISED WHILE THE TRACKER RUNS", flush=True)
tracker.kill()
deadline = time.monotonic() + 30
while tracker.status() != psutil.STATUS_ZOMBIE:
    assert time.monotonic() < deadline, tracker.status()
    time.sleep(0.05)
assert not pool_module._resource_tracker_running()
[warmed] = pool.warm_up(operator.add)
warmed.result(60)
print("SCORE", pool.score(operator.add, 1.0, 2.0), flush=True)
new = [p for p in psutil.Process().children()
       if "multiprocessing.resource_tracker" in " ".join(p.cmdline()) and p.pid != tracker.pid]
print("NEW TRACKER", len(new) == 1 and new[0].status() != psutil.STATUS_ZOMBIE, flush=True)
pool.close()
'''


def test_a_pool_started_as_its_resource_tracker_ends_starts_again_with_a_new_tracker():
    """The pool's start registers its locks with multiprocessing's resource tracker; a tracker that ended in the
    moment between the standard library's check and the registration fails the start with a broken pipe (seen
    under CI, in `train`'s reward warm-up). With the tracker gone for real (killed), the pool is replaced and the
    replacement starts a new tracker and scores; with the tracker still running, the error is not passed over."""
    done = subprocess.run([sys.executable, "-c", _TRACKER_GONE], cwd=Path(__file__).resolve().parents[1],
                          env={**os.environ, "AREAL_FORKSERVER": "0"}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "RAISED WHILE THE TRACKER RUNS" in done.stdout, done.stdout + done.stderr
    assert "SCORE 3.0" in done.stdout and "NEW TRACKER True" in done.stdout, done.stdout + done.stderr
    assert "multiprocessing's resource tracker is gone" in done.stderr, done.stderr

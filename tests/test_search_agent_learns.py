"""The search agent's CPU default learns: configs/search_agent.yaml, shortened, raises the mean F1 and searches.

The warm-started base model (warm_start/search.py) is built by the fixture as the run would build it (~2-5 min
on 2 busy cores); the run is the config's with 20 iterations (~40-60 s). Seeds 1-3 measured by hand: batch F1
over the first 3 iterations ~0.25, over the last 3 ~0.45.

The run is not bitwise the same from one machine's load to the next (the CPU server's logprobs differ by ~1e-6
with how requests batch, tests/_rollouts.py, and a token sampled near a tie now and then sends an episode another
way), so its rise is measured by the line through all 20 iterations: a CI run whose first iteration drew a lucky
batch (0.34 against the next five's 0.25) rose 0.08 by the 3-iteration windows and 0.10 by the line."""

from __future__ import annotations

import pytest

from areal_pipeline.metrics import summarize
from areal_pipeline.pipeline import run_plain
from areal_pipeline.run_spec import load_config
from _learning_helpers import REPO, base_model, fitted_rise

CONFIG = REPO / "configs/search_agent.yaml"


@pytest.fixture(scope="module")
def search_model_dir(model_cache) -> str:
    return base_model("search_agent.yaml", model_cache)


# The warm start in the fixture counts against the test's time: ~2-5 min on 2 busy cores, 9 with 4 runs at once.
@pytest.mark.timeout(1800)
def test_the_search_agent_learns_to_search_and_answer(search_model_dir, tmp_path):
    cfg = load_config(CONFIG, [f"output_dir={tmp_path}", f"model.path={search_model_dir}", "total_iterations=20"])
    records = run_plain(cfg)
    summary = summarize(records)
    curve = [(round(r["reward_mean"], 2), round(r["agent/searched"], 2)) for r in records]
    assert fitted_rise(records) > 0.07, curve
    assert all(0 <= searched <= 1 for _, searched in curve) and "searched" in summary["agent"]
    searched_first, searched_last = summary["agent"]["searched"]
    assert searched_last > searched_first, curve  # it learns to search (by hand: ~0.75 -> ~0.97)

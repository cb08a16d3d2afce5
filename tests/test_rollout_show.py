"""Trying a workflow before training: `areal-pipeline rollout --show N` and `try_workflow`, on real servers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from areal_pipeline.data.shards import read_manifest
from areal_pipeline.data.trajectory import Trajectory
from areal_pipeline.model import load_tokenizer
from areal_pipeline.rollout.try_workflow import episode_turns, format_episode, try_workflow
from areal_pipeline.run_spec import load_config

REPO = Path(__file__).resolve().parents[1]


def rollout_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli", "--log-level", "WARNING", "rollout", *args],
                          capture_output=True, text=True, timeout=300, cwd=REPO)


def test_show_rolls_out_fresh_episodes_even_where_the_iteration_is_cached(tiny_model_dir, tmp_path):
    common = ["--config", "configs/tiny_cpu.yaml", f"output_dir={tmp_path}", f"model.path={tiny_model_dir}",
              "run_id=r", "rollout.batch_size=3", "rollout.gconfig.n_samples=2"]
    written = rollout_cli(*common)
    assert written.returncode == 0, written.stderr
    out_dir = tmp_path / "r" / "iter_1" / "rollout"
    manifest = (out_dir / "manifest.json").read_bytes()

    shown = rollout_cli(*common, "--show", "2")
    assert shown.returncode == 0, shown.stderr
    out = shown.stdout
    # 2 episodes x 2 samples, each decoded: the prompt's user turn and the model's turn, then the facts
    for episode in (0, 1):
        for sample in (0, 1):
            assert f"=== episode {episode}, sample {sample} (prompt arithmetic-train-" in out, out
    assert out.count("  [user] What is ") == 4 and out.count("  [assistant]") == 4, out
    assert out.count("facts: answer=") == 4, out
    assert "2 episode(s) of rlvr rolled out now (4 trajectories)" in out, out
    assert "cached" not in out + shown.stderr
    assert (out_dir / "manifest.json").read_bytes() == manifest  # nothing of the run's was rewritten

    again = rollout_cli(*common)  # the plain command says loudly that it reports a cached rollout
    assert again.returncode == 0, again.stderr
    assert "NOTE: iteration 1's rollout was already written" in again.stderr and str(out_dir) in again.stderr
    assert read_manifest(out_dir)["stats"]["num_trajectories"] == 6


def test_try_workflow_runs_rlvr_episodes_and_stops_its_servers(tiny_model_dir, tmp_path):
    cfg = load_config(REPO / "configs/tiny_cpu.yaml", [f"output_dir={tmp_path}", f"model.path={tiny_model_dir}",
                                                       "rollout.gconfig.n_samples=3"])
    trajectories = try_workflow(cfg, 2, log_dir=tmp_path / "logs")
    assert len(trajectories) == 6
    assert len({t.prompt_id for t in trajectories}) == 2 and [t.sample_idx for t in trajectories[:3]] == [0, 1, 2]
    tokenizer = load_tokenizer(tiny_model_dir)
    text = format_episode(trajectories[0], tokenizer, index=0)
    assert "[user] What is " in text and "[assistant]" in text and f"reward {trajectories[0].reward:g}" in text
    assert not (tmp_path / cfg.run_id / "iter_1").exists()  # nothing written but the servers' logs
    # own prompts, as the tutorials' rollout_batch(sample_data, workflow)
    records = [{"prompt_id": "mine", "messages": [{"role": "user", "content": "What is 2+2?"}], "answer": "4"}]
    mine = try_workflow(cfg, 1, records=records, log_dir=tmp_path / "logs")
    assert [t.prompt_id for t in mine] == ["mine"] * 3 and mine[0].messages[0]["content"] == "What is 2+2?"


def test_try_workflow_runs_the_search_agent_with_its_retrieval_server(tiny_model_dir, tmp_path):
    cfg = load_config(REPO / "configs/search_agent.yaml", [f"output_dir={tmp_path}", f"model.path={tiny_model_dir}",
                                                           "rollout.gconfig.n_samples=2"])
    trajectories = try_workflow(cfg, 2, log_dir=tmp_path / "logs")
    assert len(trajectories) == 4 and all(t.metadata.get("error") is None for t in trajectories)
    assert (tmp_path / "logs" / "retrieval-server.log").is_file()  # the retrieval server was started for it
    text = format_episode(trajectories[0], load_tokenizer(tiny_model_dir))
    assert "[user]" in text and "[assistant]" in text


def test_turns_are_decoded_with_roles_and_tool_results_marked(tiny_model_dir):
    """A search episode (model turn, retrieved documents, model turn) and a reflection one (per-turn messages)."""
    tokenizer = load_tokenizer(tiny_model_dir)
    prompt = tokenizer.encode("Where was Ada born?", add_special_tokens=False)
    search = tokenizer.encode("<search> Ada </search>", add_special_tokens=False)
    docs = tokenizer.encode("\n\n<information>Doc 1 (Title: Ada) Ada was born in Kaven.</information>\n\n",
                            add_special_tokens=False)
    answer = tokenizer.encode("<answer> Kaven </answer>", add_special_tokens=False)
    ids = prompt + search + docs + answer
    mask = [0] * len(prompt) + [1] * len(search) + [0] * len(docs) + [1] * len(answer)
    t = Trajectory("p", "p", 0, ids, mask, [0.0] * len(ids), [0] * len(ids), 1.0, num_turns=2, stop_reason="stop",
                   messages=[{"role": "user", "content": "Where was Ada born?"},
                             {"role": "assistant", "content": tokenizer.decode(ids[len(prompt):])}],
                   metadata={"answer": ["Kaven"], "num_searches": 1, "turns": [{"a": 1}]})
    assert episode_turns(t, tokenizer) == [
        ("user", "Where was Ada born?"), ("assistant", "<search> Ada </search>"),
        ("tool", "\n\n<information>Doc 1 (Title: Ada) Ada was born in Kaven.</information>\n\n"),
        ("assistant", "<answer> Kaven </answer>")]
    text = format_episode(t, tokenizer)
    assert "  [tool result] <information>Doc 1" in text and "facts: answer=['Kaven'], num_searches=1" in text

    reflection = Trajectory("q", "q", 1, [1, 2, 3], [0, 1, 1], [0.0] * 3, [0] * 3, 0.9, num_turns=2, messages=[
        {"role": "user", "content": "What is 1+1?"}, {"role": "assistant", "content": "3"},
        {"role": "user", "content": "please try to answer it again"}, {"role": "assistant", "content": "2"}])
    assert [role for role, _ in episode_turns(reflection, tokenizer)] == ["user", "assistant", "user", "assistant"]

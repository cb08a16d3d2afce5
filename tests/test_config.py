import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from areal_pipeline.config import ConfigError, ExperimentConfig, save_config

from areal_pipeline.run_spec import load_config

REPO = Path(__file__).resolve().parents[1]


def test_defaults_file_and_overrides_layer():
    cfg = load_config(REPO / "configs/tiny_cpu.yaml", ["rollout.gconfig.n_samples=3", "seed=7",
                                                       "dataset.arithmetic_operators=[+,-]"])
    assert isinstance(cfg, ExperimentConfig)
    assert cfg.rollout.gconfig.n_samples == 3 and cfg.seed == 7
    assert cfg.dataset.arithmetic_operators == ["+", "-"]
    from omegaconf import OmegaConf

    assert cfg.rollout.batch_size == OmegaConf.load(REPO / "configs/tiny_cpu.yaml").rollout.batch_size  # the file's
    assert cfg.inference.setup_timeout == 300.0  # a default
    assert cfg.run_dir == Path("runs") / "tiny-cpu"


@pytest.mark.parametrize("overrides, run_id", [([], None), (["run_id=abc"], None), (["run_id=abc", "run_id=7"], None),
                                               (["run_id=abc"], "given"), (["seed=3"], None)])
def test_the_run_id_read_without_loading_is_the_loaded_ones(tmp_path, overrides, run_id):
    """`run_id_of` (what names a train flow run before its config loads) agrees with the config `load_run` loads:
    the run_id parameter, else the last override, else the file, else the default."""
    from areal_pipeline.run_spec import resolve_run_config, run_id_of

    for path in (REPO / "configs/tiny_cpu.yaml", REPO / "configs/search_agent.yaml"):
        assert run_id_of(path, overrides, run_id) == resolve_run_config(path, overrides, run_id).run_id
    bare = tmp_path / "bare.yaml"
    bare.write_text("seed: 1\n")
    assert run_id_of(bare, overrides, run_id) == resolve_run_config(bare, overrides, run_id).run_id


def test_unknown_override_names_closest_keys():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["rollout.gconfig.n_sample=4"])
    assert "unknown config key 'rollout.gconfig.n_sample'" in str(err.value)
    assert "rollout.gconfig.n_samples" in str(err.value)


def test_unknown_key_in_file_names_file_and_valid_keys(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("rollout:\n  batchsize: 3\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert str(path) in message and "rollout.batchsize" in message and "rollout.batch_size" in message


def test_bad_values_and_forms():
    with pytest.raises(ConfigError, match="invalid config value"):
        load_config(None, ["seed=abc"])
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["seed"])
    with pytest.raises(ConfigError, match="not found"):
        load_config("/nonexistent.yaml")


def test_saved_config_loads_back_equal(tmp_path):
    cfg = load_config(REPO / "configs/tiny_cpu.yaml", ["run_id=abc", "inference.sglang.tp_size=2"])
    path = save_config(cfg, tmp_path / "config.yaml")
    assert load_config(path) == cfg


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    load_config(path)


# (override, the start of the error: the dotted key and the value, what is allowed)
BAD_VALUES = [
    ("rollout.batch_size=0", "rollout.batch_size=0: must be >= 1"),
    ("rollout.gconfig.n_samples=0", "rollout.gconfig.n_samples=0: must be >= 1"),
    ("trainer.optimizer.lr=-1", "trainer.optimizer.lr=-1.0: must be > 0"),
    ("trainer.optimizer.lr=0", "trainer.optimizer.lr=0.0: must be > 0"),
    ("rollout.gconfig.temperature=nan", "rollout.gconfig.temperature=nan: must be a finite number"),
    ("rollout.gconfig.temperature=-0.5", "rollout.gconfig.temperature=-0.5: must be >= 0"),
    ("trainer.optimizer.beta2=inf", "trainer.optimizer.beta2=inf: must be a finite number"),
    ("ppo.reward_scaling=nan", "ppo.reward_scaling=nan: must be a finite number"),
    ("rollout.gconfig.top_p=0", "rollout.gconfig.top_p=0.0: must be in (0, 1]"),
    ("rollout.gconfig.top_k=0", "rollout.gconfig.top_k=0: must be -1 (no top-k) or >= 1"),
    ("rollout.gconfig.stop_token_ids=[2,-1]", "rollout.gconfig.stop_token_ids=[2, -1]: must be a list of values >= 0"),
    ("ppo.adv_norm.std_level=prompt", "ppo.adv_norm.std_level='prompt': must be one of group, batch, none"),
    ("ppo.c_clip=1", "ppo.c_clip=1.0: must be > 1"),
    ("trainer.weight_sync=nccl", "trainer.weight_sync='nccl': must be one of disk, distributed"),
    ("save_freq=0", "save_freq=0: must be >= 1"),
    ("inference.base_port=70000", "inference.base_port=70000: must be in [0, 65535]"),
    ("model.tiny.pretrain_off_by_one=1.5", "model.tiny.pretrain_off_by_one=1.5: must be in [0, 1]"),
    ("model.path=/nonexistent/dir", "model.path='/nonexistent/dir': must be an existing local path or a hub id"),
    ("model.path=./no/such/model", "model.path='./no/such/model': must be an existing local path or a hub id"),
    ("dataset.path=/nonexistent/train.jsonl", "dataset.path='/nonexistent/train.jsonl': must be an existing local"),
    ("rollout.agent.retrieval.corpus=/nonexistent/corpus.jsonl",
     "rollout.agent.retrieval.corpus='/nonexistent/corpus.jsonl': must be an existing file"),
    # rules between fields
    ("model.tiny.num_attention_heads=3",
     "model.tiny.hidden_size=64: must be a multiple of model.tiny.num_attention_heads=3"),
    ("rollout.agent.retrieval.topk=60",
     "rollout.agent.retrieval.topk=60: must be <= rollout.agent.retrieval.max_topk=50"),
    ("rollout.gconfig.max_new_tokens=1024",
     "rollout.gconfig.max_new_tokens=1024: must be < inference.context_length=1024"),
    ("dataset.max_test_size=0", "eval_freq=1: must be 0 when the test split is empty (dataset.max_test_size=0)"),
    # SGLang: its own environment's python, its --dtype names, no distributed sync with dp_size > 1
    ("inference.sglang.python=/nonexistent/bin/python",
     "inference.sglang.python='/nonexistent/bin/python': must be empty or an executable file"),
    ("inference.sglang.dtype=int8", "inference.sglang.dtype='int8': must be one of auto, half, float16, bfloat16"),
    ("trainer.weight_sync_bucket_mb=0", "trainer.weight_sync_bucket_mb=0: must be >= 1"),
    # LoRA: a shape, a scale, a dropout, layers it can sit on, an initialisation that leaves the base as it is
    ("trainer.lora.rank=0", "trainer.lora.rank=0: must be >= 1"),
    ("trainer.lora.alpha=0", "trainer.lora.alpha=0.0: must be > 0"),
    ("trainer.lora.dropout=1", "trainer.lora.dropout=1.0: must be in [0, 1)"),
    ("trainer.lora.target_modules=[lm_head]",
     "trainer.lora.target_modules=['lm_head']: must be [all-linear] or names among q_proj, k_proj, v_proj, o_proj"),
    ("trainer.lora.target_modules=[]", "trainer.lora.target_modules=[]: must be [all-linear] or names among"),
    ("trainer.lora.init=pissa", "trainer.lora.init='pissa': must be one of kaiming, gaussian"),
]


def test_masking_failed_episodes_needs_groups_that_can_keep_enough_survivors():
    overrides = ["rollout.on_failure=mask", "rollout.gconfig.n_samples=2", "rollout.min_group_survivors=3"]
    with pytest.raises(ConfigError, match=r"^rollout.min_group_survivors=3: must be <= rollout.gconfig.n_samples=2 "
                                          r"with rollout.on_failure='mask'"):
        load_config(REPO / "configs/tiny_cpu.yaml", overrides)
    # the same sizes are fine where failed groups are dropped, and a group of 3 can keep 3
    assert load_config(REPO / "configs/tiny_cpu.yaml", ["rollout.on_failure=drop", *overrides[1:]])
    assert load_config(REPO / "configs/tiny_cpu.yaml", [*overrides[:1], "rollout.gconfig.n_samples=3",
                                                        *overrides[2:]]).rollout.min_group_survivors == 3
    with pytest.raises(ConfigError, match=r"rollout.on_failure='retry': must be one of drop, mask, refill, fail"):
        load_config(REPO / "configs/tiny_cpu.yaml", ["rollout.on_failure=retry"])


def test_sglangs_python_must_be_executable(tmp_path):
    script = tmp_path / "python"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o644)
    with pytest.raises(ConfigError, match=rf"^inference.sglang.python='{script}': must be empty or an executable file"):
        load_config(REPO / "configs/tiny_cpu.yaml", [f"inference.sglang.python={script}"])
    script.chmod(0o755)
    assert load_config(REPO / "configs/tiny_cpu.yaml", [f"inference.sglang.python={script}"]).inference.sglang.python


def test_distributed_sync_refuses_data_parallel_sglang_servers():
    with pytest.raises(ConfigError, match=r"^inference.sglang.dp_size=2: must be 1 with trainer.weight_sync='distributed'"):
        load_config(REPO / "configs/tiny_cpu.yaml", ["inference.backend=sglang", "inference.sglang.dp_size=2",
                                                     "trainer.weight_sync=distributed", "trainer.device=cuda"])
    load_config(REPO / "configs/tiny_cpu.yaml", ["inference.backend=sglang", "inference.sglang.dp_size=2",
                                                 f"inference.sglang.python={sys.executable}"])  # disk sync: fine


@pytest.mark.parametrize("override, error", BAD_VALUES, ids=[o for o, _ in BAD_VALUES])
def test_bad_value_is_rejected_at_load_naming_key_value_and_rule(override, error):
    with pytest.raises(ConfigError) as err:
        load_config(REPO / "configs/tiny_cpu.yaml", [override])
    assert str(err.value).startswith(error)


def test_every_broken_value_is_named_at_once():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["rollout.batch_size=0", "trainer.optimizer.lr=-1"])
    assert str(err.value) == "rollout.batch_size=0: must be >= 1; trainer.optimizer.lr=-1.0: must be > 0"


def test_type_error_names_its_key_on_one_line():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["seed=abc"])
    assert str(err.value).startswith("seed: invalid config value: Value 'abc'") and "\n" not in str(err.value)


def test_every_numeric_field_has_a_rule():
    """A new int or float field needs its rule in FIELD_RULES (at least "finite"), or a bad value of it is only
    found at run time."""
    import dataclasses
    import typing

    from areal_pipeline.config import FIELD_RULES

    def numeric_fields(schema, prefix=""):
        for f in dataclasses.fields(schema):
            hint = typing.get_type_hints(schema)[f.name]
            if dataclasses.is_dataclass(hint):
                yield from numeric_fields(hint, f"{prefix}{f.name}.")
            elif {int, float} & set(typing.get_args(hint) or (hint,)):
                yield schema, f.name, prefix + f.name

    missing = [key for schema, name, key in numeric_fields(ExperimentConfig) if name not in FIELD_RULES.get(schema, {})]
    assert not missing, f"numeric config fields without a rule: {missing}"
    stale = [f"{schema.__name__}.{name}" for schema, rules in FIELD_RULES.items() for name in rules
             if name not in {f.name for f in dataclasses.fields(schema)}]
    assert not stale, f"rules for fields that do not exist: {stale}"


def test_model_path_hub_ids_and_existing_directories_pass(tmp_path, monkeypatch):
    assert load_config(None, ["model.path=Qwen/Qwen2.5-1.5B-Instruct"]).model.path == "Qwen/Qwen2.5-1.5B-Instruct"
    assert load_config(None, ["model.path=gpt2"]).model.path == "gpt2"
    assert load_config(None, [f"model.path={tmp_path}"]).model.path == str(tmp_path)
    # "runs/x" is a hub id in form, but ./runs exists: it means a local directory, which is missing
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    with pytest.raises(ConfigError, match=r"^model.path='runs/x': must be an existing local path"):
        load_config(None, ["model.path=runs/x"])


def test_resolve_model_path_checks_a_config_built_in_code(tmp_path):
    from areal_pipeline.config import ModelConfig
    from areal_pipeline.model import resolve_model_path

    with pytest.raises(ConfigError, match=r"^model.path='/nonexistent/dir'"):
        resolve_model_path(ModelConfig(path="/nonexistent/dir"), tmp_path, seed=1)


def test_dataset_path_must_exist_and_hold_rows(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    with pytest.raises(ConfigError, match=rf"^dataset.path='{empty}': must be a file with rows \(this one is empty\)"):
        load_config(None, ["dataset.name=gsm8k", f"dataset.path={empty}"])
    with pytest.raises(ConfigError, match=r"^dataset.path='data/train.jsonl': must be an existing local path"):
        load_config(None, ["dataset.name=gsm8k", "dataset.path=data/train.jsonl"])  # a file name, not a hub id
    rows = tmp_path / "train.jsonl"
    rows.write_text('{"question": "q", "answer": "#### 1"}\n')
    assert load_config(None, ["dataset.name=gsm8k", f"dataset.path={rows}"]).dataset.path == str(rows)
    assert load_config(None, ["dataset.name=gsm8k", f"dataset.path={tmp_path}"]).dataset.path == str(tmp_path)
    assert load_config(None, ["dataset.name=gsm8k", "dataset.path=openai/gsm8k"]).dataset.path == "openai/gsm8k"


def test_optional_fields_none_means_off():
    cfg = load_config(None, ["ppo.c_clip=null", "dataset.max_train_size=null", "inference.sglang.context_length=null"])
    assert cfg.ppo.c_clip is None and cfg.dataset.max_train_size is None


def _cli_train(*overrides: str, output_dir) -> tuple[subprocess.CompletedProcess, float, float]:
    """Run `areal-pipeline train`; its result, wall seconds and CPU seconds (the machine may be busy with other
    tests: the CPU time says how much work the command did, however long it waited for a core)."""
    cpu_before, started = _children_cpu_seconds(), time.monotonic()
    done = subprocess.run([sys.executable, "-m", "cli", "train", "--config", "configs/tiny_cpu.yaml",
                           f"output_dir={output_dir}", *overrides], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    return done, time.monotonic() - started, _children_cpu_seconds() - cpu_before


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@pytest.mark.parametrize("override, key", [("rollout.batch_size=0", "rollout.batch_size"),
                                           ("model.path=/nonexistent/dir", "model.path"),
                                           ("rollout.gconfig.temperature=nan", "rollout.gconfig.temperature")])
def test_cli_train_rejects_a_bad_value_before_starting_anything(tmp_path, override, key):
    done, wall_s, cpu_s = _cli_train(override, output_dir=tmp_path)
    last_line = (done.stdout + done.stderr).strip().splitlines()[-1]
    assert done.returncode != 0
    assert last_line.startswith(f"config error: {key}="), last_line
    # ~4 s (imports) on an idle machine; the model build and the flow it used to reach first took 40-80 s
    assert cpu_s < 10, f"took {cpu_s:.1f} s of CPU ({wall_s:.1f} s wall)"  # CPU, not wall: a busy machine waits
    assert not any(tmp_path.iterdir())  # nothing made: no model, no dataset, no run directory


def test_cli_train_names_a_malformed_data_row_before_starting_anything(tmp_path):
    data = tmp_path / "data" / "gsm8k.jsonl"
    data.parent.mkdir()
    data.write_text('{"question": "1+1?", "answer": "#### 2"}\n{"question": "2+2?", "answer": \n')
    out = tmp_path / "out"
    out.mkdir()
    done, wall_s, cpu_s = _cli_train("dataset.name=gsm8k", f"dataset.path={data}", output_dir=out)
    last_line = (done.stdout + done.stderr).strip().splitlines()[-1]
    assert done.returncode != 0
    assert last_line.startswith(f"data error: {data}, line 2: invalid JSON"), last_line
    assert cpu_s < 10, (cpu_s, wall_s)
    assert not any(out.iterdir())


def test_a_yaml_syntax_error_is_a_config_error_naming_the_place(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("rollout: {batch_size: 4\nseed: 3\n")
    with pytest.raises(ConfigError, match=rf"{broken} is not valid YAML: .* line \d+, column \d+"):
        load_config(broken)


def test_the_search_warm_start_runs_only_in_the_format_it_was_written_in():
    """The embedded search model learnt whole episodes with the question alone and one result a search: another
    prompt or top-k would hand it a format it never saw, so the config refuses it, naming the ways out."""
    with pytest.raises(ConfigError) as refused:
        load_config("configs/search_agent.yaml", ["rollout.agent.retrieval.topk=3", "rollout.agent.prompt=chat"])
    message = str(refused.value)
    assert "rollout.agent.retrieval.topk=3: must be 1" in message and "rollout.agent.prompt='chat': must be" in message
    assert "model.tiny.pretrain_steps=0, or model.path" in message
    # the same settings with a model of the user's own, or an untrained embedded one, are fine
    for way_out in ("model.path=Qwen/Qwen2.5-1.5B-Instruct", "model.tiny.pretrain_steps=0"):
        cfg = load_config("configs/search_agent.yaml", ["rollout.agent.retrieval.topk=3", way_out])
        assert cfg.rollout.agent.retrieval.topk == 3


def test_remax_refuses_the_ppo_loss():
    """ReMax's unnormalised +-1 advantages are for the REINFORCE loss: PPO's clipping would cut them."""
    with pytest.raises(ConfigError, match=r"ppo.loss='ppo': must be reinforce .* with ppo.advantage=remax"):
        load_config("configs/remax.yaml", ["ppo.loss=ppo"])
    cfg = load_config("configs/remax.yaml", [])
    assert (cfg.ppo.loss, cfg.ppo.advantage, cfg.rollout.workflow) == ("reinforce", "remax", "rlvr")
    with pytest.raises(ConfigError, match=r"ppo.loss='ppo': must be reinforce .* with ppo.advantage=remax"):
        load_config(None, ["ppo.advantage=remax"])  # whatever the workflow
    with pytest.raises(ConfigError, match=r"ppo.advantage='gae': must be grpo, remax, gigpo, or 'module:attr' naming an "
                                          r"importable advantage builder"):
        load_config(None, ["ppo.advantage=gae"])


def test_config_command_prints_what_a_key_means():
    """`areal-pipeline config KEY`: type, default, the rule's allowed values and the field's own comment; a
    section lists its keys; an unknown key is a config error naming the close ones."""
    done = subprocess.run([sys.executable, "-m", "cli", "config", "ppo.loss", "rollout.gconfig"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ppo.loss: str, default 'ppo'\n  allowed: ppo, reinforce, or 'module:attr'")
    assert "a loss builder of your own" in done.stdout  # the comment beside the field in config/schema.py
    assert "rollout.gconfig.n_samples = 4" in done.stdout and "rollout.gconfig.temperature = 1.0" in done.stdout
    wrong = subprocess.run([sys.executable, "-m", "cli", "config", "ppo.lss"], cwd=REPO,
                           capture_output=True, text=True, timeout=120)
    assert wrong.returncode != 0
    assert "unknown config key 'ppo.lss'; did you mean ppo.loss" in wrong.stdout + wrong.stderr


def _sections_of(schema: type, prefix: str = "") -> list[type]:
    """`schema` and every section class below it, the built-in workflows' rollout.agent sections included."""
    import dataclasses

    from areal_pipeline.config import section_type
    from areal_pipeline.run_spec import builtin_sections

    found = [schema]
    for f in dataclasses.fields(schema):
        sub = section_type(schema, f, builtin_sections(), prefix + f.name)
        if sub is not None and sub not in found:
            found += [s for s in _sections_of(sub, f"{prefix}{f.name}.") if s not in found]
    return found


@pytest.mark.parametrize("section", [pytest.param(s, id=s.__name__) for s in _sections_of(ExperimentConfig)])
def test_every_config_key_has_help_the_config_command_prints(section):
    import dataclasses

    from areal_pipeline.config_help import _field_comments

    documented = _field_comments(section)
    assert [f.name for f in dataclasses.fields(section) if not documented.get(f.name)] == []


def test_the_builtin_workflows_sections_agree_on_the_keys_they_share():
    """AgentConfig is made of the built-in workflows' sections: a key two of them declare has one default."""
    import dataclasses

    from areal_pipeline.workflows.agent_config import AgentConfig

    defaults: dict[str, set] = {}
    for base in AgentConfig.__mro__[1:]:
        if dataclasses.is_dataclass(base):
            for f in dataclasses.fields(base):
                default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
                defaults.setdefault(f.name, set()).add(repr(default))
    assert {name: values for name, values in defaults.items() if len(values) > 1} == {}
    assert set(defaults) == {f.name for f in dataclasses.fields(AgentConfig)}


def test_a_run_is_assembled_once_from_its_config():
    """load_run turns the config's names into what they name: the workflow class, its section, its reward function
    and tools; the leaf loader alone knows no workflow (rollout.agent is empty, a workflow key unknown)."""
    from areal_pipeline.config import NoAgentConfig, load
    from areal_pipeline.run_spec import load_run
    from areal_pipeline.workflows.agent_config import AgentConfig
    from areal_pipeline.workflows.search_agent import SearchAgentWorkflow

    run = load_run("configs/search_agent.yaml", ["seed=5"], run_id="assembled")
    assert (run.workflow_class, run.workflow_section, run.tools) == (SearchAgentWorkflow, AgentConfig, ("retrieval",))
    assert (run.cfg.run_id, run.cfg.seed, run.loss, run.reward) == ("assembled", 5, run.cfg.ppo.loss, None)
    assert str(load_run("configs/tiny_cpu.yaml").reward) == "areal_pipeline.rewards.math:math_reward"
    assert isinstance(load("configs/tiny_cpu.yaml").rollout.agent, NoAgentConfig)
    with pytest.raises(ConfigError, match=r"unknown config key 'rollout.agent.max_turns'"):
        load(None, ["rollout.agent.max_turns=3"])


def test_the_trainer_reads_a_saved_config_without_importing_the_workflow(tmp_path):
    """The trainer's processes load the run's saved config with rollout.agent kept as written: a workflow module
    they cannot (or need not) import is no error there, while loading it as a run is."""
    from areal_pipeline.config import UNCHECKED_AGENT, load

    saved = tmp_path / "config.yaml"
    saved.write_text(f"rollout:\n  workflow: {tmp_path / 'gone.py'}:Agent\n  agent:\n    depth: 3\n")
    cfg = load(saved, chosen=UNCHECKED_AGENT)
    assert cfg.rollout.agent == {"depth": 3}
    with pytest.raises(ConfigError, match=rf"{saved}: rollout.workflow='{tmp_path / 'gone.py'}:Agent'"):
        load_config(saved)

from pathlib import Path

import pytest

from areal_pipeline.config import ConfigError, ExperimentConfig, load_config, save_config

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

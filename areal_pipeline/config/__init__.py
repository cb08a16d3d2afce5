"""Experiment configuration: dataclasses loaded from YAML, with dotted command-line overrides. The ground floor of
the project: it imports nothing of it but `errors`.

    schema.py   the sections' dataclasses, each field documented beside it
    rules.py    what each value may be (FIELD_RULES, CROSS_RULES) and `validate`
    loading.py  YAML + overrides, key checks (an unknown key names the closest valid ones), `save_config`

A run's config is loaded by the run assembly, which chooses `rollout.agent`'s class from the selected workflow and
adds the rules that need the project's registries:

    from areal_pipeline.run_spec import load_config
    cfg = load_config("configs/tiny_cpu.yaml", ["rollout.gconfig.n_samples=4", "seed=3"])

`load` here reads a config with the generic rules alone (`rollout.agent` empty, or as `chosen` says).
"""

from areal_pipeline.config.loading import (UNCHECKED_AGENT, Chosen, ChosenSection, Layer, build_config, layered_value,
                                           load, read_layers, save_config, section_type, to_dict, to_yaml, valid_keys)
from areal_pipeline.config.lora_rules import adapter_push
from areal_pipeline.config.rules import (CROSS_RULES, FIELD_RULES, VLLM_CPU_HEAD_SIZES, ConfigError, CrossRule, Key,
                                         Rule, above, at_least, each, field_rules_of, looks_like_local_path, one_of,
                                         validate, within)
from areal_pipeline.config.schema import (DatasetConfig, ExperimentConfig, GenerationConfig, InferenceConfig,
                                          ModelConfig, NoAgentConfig, NormConfig, OptimizerConfig, PPOConfig,
                                          RetrievalConfig, RolloutConfig, SGLangConfig, TinyModelConfig, TrainerConfig,
                                          VLLMConfig)

__all__ = [
    "CROSS_RULES", "FIELD_RULES", "UNCHECKED_AGENT", "VLLM_CPU_HEAD_SIZES", "Chosen", "ChosenSection", "ConfigError",
    "CrossRule", "adapter_push", "DatasetConfig", "ExperimentConfig", "GenerationConfig", "InferenceConfig", "Key", "Layer",
    "ModelConfig", "NoAgentConfig", "NormConfig", "OptimizerConfig", "PPOConfig", "RetrievalConfig", "RolloutConfig",
    "Rule", "SGLangConfig", "TinyModelConfig", "TrainerConfig", "VLLMConfig", "above", "at_least", "build_config",
    "each", "field_rules_of", "layered_value", "load", "looks_like_local_path", "one_of", "read_layers",
    "save_config", "section_type", "to_dict", "to_yaml", "valid_keys", "validate", "within",
]

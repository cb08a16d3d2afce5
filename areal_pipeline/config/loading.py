"""Loading a config: defaults <- YAML file <- dotted `key=value` overrides, each layer's keys checked against the
schema (an unknown key is an error naming the closest valid ones, so a typo never falls back to a default), then
the values against the rules (config/rules.py).

A section whose class depends on another value (`rollout.agent` on `rollout.workflow`) is chosen by the caller:
`read_layers` gives the layers as written, the caller picks the section classes from them (the run assembly,
areal_pipeline/run_spec.py, from the selected workflow), and `build_config` merges and checks them.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import tempfile
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Optional

import yaml
from omegaconf import OmegaConf

from areal_pipeline.config.rules import CROSS_RULES, FIELD_RULES, ConfigError, CrossRules, FieldRules, validate
from areal_pipeline.config.schema import ExperimentConfig


@dataclass(frozen=True)
class ChosenSection:
    """A section whose class depends on another value (`rollout.agent` on `rollout.workflow`), as chosen at load.
    A schema of `dict` keeps the section as written, unchecked (a reader that never looks at it: the trainer)."""

    schema: type  # the dataclass its values load into
    owner: str  # what chose it, for messages: "workflow reflection"
    keys: tuple[str, ...]  # the keys the owner reads (a subset of schema's fields)


Chosen = dict[str, ChosenSection]  # dotted key of a section -> its chosen class

# rollout.agent kept as written: for a process that reads the run's saved config but never the workflow's section
UNCHECKED_AGENT: Chosen = {"rollout.agent": ChosenSection(dict, "any workflow", ())}


# Keys that moved, former top-level name -> its dotted key now: a config written before still loads (a run's saved
# config.yaml among them), the value going to the new key; one setting both is an error.
RENAMED_KEYS = {"tensorboard": "trackers.tensorboard"}


class Layer(NamedTuple):
    node: Any  # the layer as OmegaConf read it
    data: Any  # its plain data, for the key checks
    where: str  # where it comes from, for messages: the file, or "override 'k=v'"


def valid_keys(schema: type, prefix: str = "", chosen: Optional[Chosen] = None) -> list[str]:
    keys = []
    for f in dataclasses.fields(schema):
        name = prefix + f.name
        keys.append(name)
        sub = section_type(schema, f, chosen, name)
        if sub is not None and sub is not dict:
            keys.extend(valid_keys(sub, name + ".", chosen))
    return keys


def section_type(schema: type, f: dataclasses.Field, chosen: Optional[Chosen] = None,
                    dotted: str = "") -> Optional[type]:
    """The section class of field `f` (None: a plain value). A field typed Any whose metadata names a "section"
    (a function returning its default class) holds a section chosen at load: `chosen[dotted]` when given."""
    if chosen and dotted in chosen:
        return chosen[dotted].schema
    hints = type_hints(schema)
    t = hints.get(f.name)
    if dataclasses.is_dataclass(t):
        return t
    section = f.metadata.get("section")
    return section() if section else None


_HINTS: dict[type, dict[str, Any]] = {}


def type_hints(schema: type) -> dict[str, Any]:
    if schema not in _HINTS:
        _HINTS[schema] = typing.get_type_hints(schema)
    return _HINTS[schema]


def _check_keys(data: Any, schema: type, where: str, prefix: str = "", chosen: Optional[Chosen] = None) -> None:
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: '{prefix.rstrip('.') or '<root>'}' must be a mapping, got {data!r}")
    names = {f.name: f for f in dataclasses.fields(schema)}
    for key, value in data.items():
        dotted = prefix + str(key)
        if key not in names:
            valid = valid_keys(schema, prefix, chosen)
            close = difflib.get_close_matches(dotted, valid, n=3, cutoff=0.5)
            hint = f"did you mean {', '.join(close)}?" if close else ""
            section = (chosen or {}).get(prefix.rstrip("."))
            if section is not None:  # name the keys of what chose the section, not every key it happens to hold
                here = f"Keys of {section.owner}: {', '.join(prefix + k for k in section.keys) or 'none'}"
            else:
                here = f"Valid keys here: {', '.join(prefix + f for f in names)}"
            raise ConfigError(f"{where}: unknown config key '{dotted}'. {hint} {here}".replace("  ", " "))
        sub = section_type(schema, names[key], chosen, dotted)
        if sub is dict:
            if not isinstance(value, (dict, type(None))):
                raise ConfigError(f"{where}: '{dotted}' must be a mapping, got {value!r}")
        elif sub is not None and value is not None:
            _check_keys(value, sub, where, dotted + ".", chosen)


def read_layers(path: str | os.PathLike | None = None, overrides: Optional[list[str]] = None) -> list[Layer]:
    """The YAML file (if any) and each `key=value` override, in the order they apply, not yet checked."""
    layers = []
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            node = OmegaConf.load(path)
        except yaml.YAMLError as e:  # the problem and its place, on one line
            raise ConfigError(f"{path} is not valid YAML: {' '.join(str(e).split())}") from None
        layers.append(Layer(node, OmegaConf.to_container(node, resolve=False) or {}, str(path)))
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form key=value")
        node = OmegaConf.from_dotlist([item])
        layers.append(Layer(node, OmegaConf.to_container(node), f"override '{item}'"))
    return layers


def layered_value(layers: list[Layer], dotted: str, default: Any) -> tuple[Any, str]:
    """The value the layers give `dotted` (the last one that sets it wins) before they are merged, and where it
    comes from ("the default" when none sets it)."""
    value, where = default, "the default"
    *parents, name = dotted.split(".")
    for layer in layers:
        node = layer.data
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and isinstance(node.get(name), str):
            value, where = node[name], layer.where
    return value, where


def _renamed(layer: Layer) -> Layer:
    """`layer` with its keys of RENAMED_KEYS at their new place."""
    old = [key for key in RENAMED_KEYS if isinstance(layer.data, dict) and key in layer.data]
    if not old:
        return layer
    node = layer.node.copy()
    for key in old:
        new = RENAMED_KEYS[key]
        if OmegaConf.select(node, new, default=None) is not None:
            raise ConfigError(f"{layer.where}: '{key}' is the former name of '{new}'; set only '{new}'")
        OmegaConf.update(node, new, node[key], merge=True)
        del node[key]
    return Layer(node, OmegaConf.to_container(node, resolve=False), layer.where)


def build_config(layers: list[Layer], schema: type = ExperimentConfig, chosen: Optional[Chosen] = None, *,
                 field_rules: FieldRules = FIELD_RULES, cross_rules: CrossRules = CROSS_RULES) -> Any:
    """A `schema` instance from its defaults and `layers`, the sections in `chosen` loaded into their chosen
    classes; every layer's keys checked, then every value against `field_rules` and `cross_rules`."""
    merged = OmegaConf.structured(schema)
    for dotted, section in (chosen or {}).items():
        *parents, name = dotted.split(".")
        node = merged
        for part in parents:
            node = node[part]
        node[name] = OmegaConf.create({}) if section.schema is dict else OmegaConf.structured(section.schema)
    if schema is ExperimentConfig:
        layers = [_renamed(layer) for layer in layers]
    for layer in layers:
        _check_keys(layer.data, schema, layer.where, chosen=chosen)
    try:
        merged = OmegaConf.merge(merged, *(layer.node for layer in layers))
        cfg = OmegaConf.to_object(merged)
    except Exception as e:  # omegaconf's type errors: keep its message, on one line led by the key
        # (its first line: the rest repeats the key and names the dataclass)
        key, message = getattr(e, "full_key", None), str(e).splitlines()[0]
        raise ConfigError(f"{key + ': ' if key else ''}invalid config value: {message}") from e
    validate(cfg, field_rules=field_rules, cross_rules=cross_rules)
    return cfg


def load(path: str | os.PathLike | None = None, overrides: Optional[list[str]] = None,
         schema: type = ExperimentConfig, chosen: Optional[Chosen] = None) -> Any:
    """A `schema` instance from defaults <- YAML file <- `key=value` overrides, checked against the generic rules.
    `rollout.agent` is the empty section unless `chosen` says otherwise: a run's config, with its workflow's
    section and every rule, is `run_spec.load_config`'s."""
    return build_config(read_layers(path, overrides), schema, chosen)


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Any) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def save_config(cfg: Any, path: str | os.PathLike) -> Path:
    """Write the resolved config (atomically: a reader sees the old file or the new one, never a part) so a run can
    always be reproduced from its directory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(to_yaml(cfg))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path

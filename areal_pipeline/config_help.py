"""Help for config keys, as `areal-pipeline config KEY ...` prints it: a key's type, default, the values its
rules take (config.field_rules_of, with run_spec.RUN_FIELD_RULES), and the comments written beside its field in its
class (config/schema.py, or a workflow's own section beside the workflow), which are its documentation. A section's key lists its fields.
`rollout.agent.*` documents the package's workflows' keys, or with `workflow=` given, that workflow's own."""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import re
from typing import Any, Optional

from areal_pipeline.config import Chosen, ConfigError, ExperimentConfig, field_rules_of
from areal_pipeline.config.loading import section_type, type_hints, valid_keys
from areal_pipeline.run_spec import RUN_FIELD_RULES, builtin_sections, chosen_sections


def _field_comments(schema: type) -> dict[str, str]:
    """Field name -> its comments in `schema` and in the bases that declare it too (a section made of several
    workflows' sections documents a shared key once per workflow, each comment naming its workflow)."""
    texts: dict[str, list[str]] = {}
    for klass in reversed(schema.__mro__):
        if dataclasses.is_dataclass(klass):
            for name, text in _own_field_comments(klass).items():
                if text and text not in texts.setdefault(name, []):
                    texts[name].append(text)
    return {name: "; ".join(parts) for name, parts in texts.items() if parts}


def _own_field_comments(schema: type) -> dict[str, str]:
    """Field name -> the comment lines just above its line in the class body and the comment at its end."""
    lines, _ = inspect.getsourcelines(schema)
    comments: dict[str, str] = {}
    above: list[str] = []
    for line in lines[1:]:
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(stripped.lstrip("# ").rstrip())
            continue
        match = re.match(r"\s+(\w+)\s*:", line)
        if match and match.group(1) in {f.name for f in dataclasses.fields(schema)}:
            trailing = line.split("#", 1)[1].strip() if "#" in line.split("=", 1)[-1] else ""
            comments[match.group(1)] = " ".join([*above, trailing]).strip()
        above = []
    return comments


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


def _resolve(key: str, chosen: Optional[Chosen] = None) -> tuple[type, Optional[dataclasses.Field]]:
    """(the section class holding `key`, its field); (ExperimentConfig, None) for the empty key."""
    schema: type = ExperimentConfig
    field: Optional[dataclasses.Field] = None
    parts = [p for p in key.split(".") if p]
    for i, part in enumerate(parts):
        fields = {f.name: f for f in dataclasses.fields(schema)}
        if part not in fields:
            close = difflib.get_close_matches(key, valid_keys(ExperimentConfig, chosen=chosen), n=3, cutoff=0.5)
            raise ConfigError(f"unknown config key '{key}'" + (f"; did you mean {', '.join(close)}?" if close else ""))
        field = fields[part]
        if i < len(parts) - 1:
            sub = section_type(schema, field, chosen, ".".join(parts[:i + 1]))
            if sub is None:
                raise ConfigError(f"unknown config key '{key}': '{'.'.join(parts[:i + 1])}' has no keys below it")
            schema = sub
    return schema, field


def key_help(key: str, workflow: Optional[str] = None) -> str:
    """Help for one dotted key (or a section: its fields, one line each). `workflow`: document `rollout.agent` as
    that workflow's section (a class of the user's own included) rather than the package's workflows' keys."""
    chosen = chosen_sections(workflow, "workflow") if workflow else builtin_sections()
    schema, field = _resolve(key, chosen)
    section = section_type(schema, field, chosen, key) if field is not None else ExperimentConfig
    if section is not None:
        comments = _field_comments(section)
        rows = []
        for f in dataclasses.fields(section):
            sub = section_type(section, f, chosen, (key + "." if key else "") + f.name)
            shown = "(section)" if sub is not None else repr(_default(f))
            text = comments.get(f.name, "")
            rows.append(f"  {(key + '.' if key else '') + f.name} = {shown}" + (f"  # {text}" if text else ""))
        own_doc = section.__doc__ if section.__doc__ and not section.__doc__.startswith(section.__name__ + "(") else ""
        return f"{key or 'the config'}: {own_doc.splitlines()[0] if own_doc else 'a section'}\n" + "\n".join(rows)
    rules = field_rules_of(schema, RUN_FIELD_RULES).get(field.name)
    allowed = " and ".join(r.allowed for r in (rules if isinstance(rules, tuple) else (rules,))) if rules else None
    kind = type_hints(schema).get(field.name)
    kind_name = str(kind).replace("typing.", "") if getattr(kind, "__args__", None) else kind.__name__
    lines = [f"{key}: {kind_name}, default {_default(field)!r}"]
    if allowed:
        lines.append(f"  allowed: {allowed}")
    text = _field_comments(schema).get(field.name)
    if text:
        lines.append(f"  {text}")
    return "\n".join(lines)

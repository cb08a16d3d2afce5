"""The command line (cli/, above flows/): its help names config keys that exist."""

from __future__ import annotations

import contextlib
import io
import re

import pytest

from areal_pipeline.config import ExperimentConfig, valid_keys
from areal_pipeline.run_spec import builtin_sections
from cli import build_parser


def _help(*argv: str) -> str:
    """What `areal-pipeline ARGV --help` prints, on one line (argparse wraps lines anywhere)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        build_parser().parse_args([*argv, "--help"])
    return " ".join(out.getvalue().split())


def test_the_help_names_real_config_keys():
    """An example override in any command's help (`e.g. rollout.gconfig.n_samples=8`) names a key the config has."""
    commands = re.search(r"\{([a-z,-]+)\}", _help()).group(1).split(",")
    assert {"train", "rollout", "config", "serve"} <= set(commands)
    text = " ".join(_help(command) for command in commands)
    named = set(re.findall(r"\b([a-z_]+(?:\.[a-z_]+)+)=", text))
    assert {"rollout.gconfig.n_samples", "trainer.optimizer.lr"} <= named
    assert sorted(named - set(valid_keys(ExperimentConfig, chosen=builtin_sections()))) == []

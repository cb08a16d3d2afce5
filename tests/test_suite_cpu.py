"""bench/suite_cpu.py's reading of the kernel's accounting records and its kinds of process."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from suite_cpu import ACCT_V3, comp_t, kind_of, read_accounting  # noqa: E402


def record(pid: int, ppid: int, start: int, utime: int, stime: int, comm: bytes, version: int = 3) -> bytes:
    return ACCT_V3.pack(0, version, 0, 0, 0, 0, pid, ppid, start, 1.5, utime, stime, 0, 0, 0, 0, 0, 0, comm)


def test_comp_t_is_a_13_bit_mantissa_with_a_base_8_exponent():
    assert ACCT_V3.size == 64  # struct acct_v3
    assert comp_t(1234) == 1234
    assert comp_t((2 << 13) | 100) == 100 * 64


def test_records_give_pid_start_cpu_seconds_and_name(tmp_path):
    path = tmp_path / "acct"
    path.write_bytes(record(41, 1, 1_800_000_000, 250, (1 << 13) | 10, b"python\0")
                     + record(42, 41, 1_800_000_001, 0, 0, b"a-name-of-16-ch\0"))
    first, second = read_accounting(path)
    assert first == {"pid": 41, "ppid": 1, "start": 1_800_000_000, "cpu": (250 + 80) / 100, "comm": "python"}
    assert (second["pid"], second["comm"], second["cpu"]) == (42, "a-name-of-16-ch", 0.0)
    path.write_bytes(record(1, 0, 0, 0, 0, b"x\0", version=2))
    with pytest.raises(ValueError, match="acct version 2, not 3"):
        read_accounting(path)


@pytest.mark.parametrize("cmd, kind", [
    ("/v/bin/python -m areal_pipeline.inference.server --model m --port 1", "CPU inference server"),
    ("/v/bin/python -m areal_pipeline.training.trainer_server --config c.yaml", "trainer rank"),
    ("/v/bin/python -B -c from multiprocessing.forkserver import main; main(5, 7, ['x'])",
     "forkserver and the services it forked"),
    ("/v/bin/python /v/bin/areal-pipeline train --config configs/tiny_cpu.yaml", "areal-pipeline train"),
    ("/v/bin/python -m cli recurring fire --config c.yaml", "areal-pipeline recurring"),
    ("/v/bin/python -m flows.api_server --port 4242", "temporary Prefect API server"),
    ("/v/bin/python /v/bin/prefect server start --host 127.0.0.1", "Prefect server (standing)"),
    ("[pytest-xdist running] tests/test_flows.py::test_x", "pytest worker"),
    ("/usr/bin/sleep 3", "other: sleep 3"),
])
def test_a_command_line_names_its_kind(cmd, kind):
    assert kind_of(cmd) == kind

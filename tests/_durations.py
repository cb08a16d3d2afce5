"""Refresh tests/durations.json, each test file's seconds (setup and calls summed), from a JUnit XML report:

    make test ARGS="--junitxml=/tmp/junit.xml" && python tests/_durations.py /tmp/junit.xml > tests/durations.json

conftest.py hands files to the xdist workers longest first, so that the long files start at once instead of
running alone at the end."""

from __future__ import annotations

import collections
import json
import sys
import xml.etree.ElementTree as ET


def file_seconds(junit_xml: str) -> dict[str, int]:
    seconds: dict[str, float] = collections.Counter()
    for case in ET.parse(junit_xml).iter("testcase"):
        module = (case.get("classname") or "").split(".")[-1]
        seconds[f"{module}.py"] += float(case.get("time") or 0)
    return {name: round(s) for name, s in sorted(seconds.items(), key=lambda pair: -pair[1])}


if __name__ == "__main__":
    print(json.dumps(file_seconds(sys.argv[1]), indent=1))

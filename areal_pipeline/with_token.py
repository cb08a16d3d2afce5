"""Run another program's server module with the run's token, without the token on any command line.

    python -m areal_pipeline.with_token --flag=--api-key -m sglang.launch_server --model-path ... --port 30000
    python -m areal_pipeline.with_token --env VLLM_API_KEY -m vllm.entrypoints.openai.api_server --model ...

SGLang takes its key as `--api-key` alone, vLLM as `--api-key` or VLLM_API_KEY. A flag on the command line shows
in `ps` to every user of the host; here the token is read from this process's environment (AREAL_PIPELINE_TOKEN
or AREAL_PIPELINE_TOKEN_FILE, auth.py) and handed to the module inside the process: appended to its sys.argv
(which /proc/<pid>/cmdline does not show) or put in its environment. With AREAL_PIPELINE_AUTH=off the module
runs as given. It imports nothing but the standard library and auth.py, so it runs on the server's own
interpreter (SGLang's and vLLM's environments) with the project on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from typing import Optional

from areal_pipeline.auth import CredentialError, service_token


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(this wrapper's options and the module, the module's own arguments): everything after `-m MODULE` is the
    module's, whatever it looks like."""
    p = argparse.ArgumentParser(prog="python -m areal_pipeline.with_token", allow_abbrev=False)
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--flag", help="the module's command-line flag for the key (e.g. --api-key)")
    how.add_argument("--env", help="the environment variable the module reads the key from (e.g. VLLM_API_KEY)")
    p.add_argument("-m", dest="module", required=True, help="the module to run, as `python -m` runs it")
    cut = argv.index("-m") + 2 if "-m" in argv else len(argv)
    return p.parse_args(argv[:cut]), argv[cut:]


def main(argv: Optional[list[str]] = None) -> None:
    args, rest = parse(sys.argv[1:] if argv is None else argv)
    try:
        token = service_token(args.module)
    except CredentialError as e:
        raise SystemExit(str(e)) from None
    if token is not None and args.env:
        os.environ[args.env] = token
    extra = [args.flag, token] if token is not None and args.flag else []
    sys.argv = [args.module, *rest, *extra]
    runpy.run_module(args.module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()

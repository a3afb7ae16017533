"""Run `train.py` several times in ONE single-rank process, each run exactly as the CLI runs it (`python train.py
ARGS`: Hydra parses the arguments, errors print `error: ...` and exit 2), its exit code, stdout and stderr kept apart.

Used by `app_runs.run_app_many`: a test of many one-rank configurations (bad settings that must fail clearly, every
model through the app) pays Python's and torch's start-up once instead of once per configuration.
Usage: python tests/helpers/app_cli.py RESULT.json '[["arg", ...], ...]' (run from the repository root)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import runpy
import sys
import traceback


def main() -> None:
    result_path, runs = sys.argv[1], json.loads(sys.argv[2])
    sys.path[0] = os.path.dirname(os.path.abspath("train.py"))  # `python train.py` puts the script's folder first
    results = []
    for args in runs:
        sys.argv = ["train.py", *args]
        out, err, code = io.StringIO(), io.StringIO(), 0
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                runpy.run_path("train.py", run_name="__main__")  # as `python train.py ARGS` would
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except BaseException:  # noqa: BLE001 - an uncaught exception is what the CLI would show: a traceback
                traceback.print_exc()
                code = 1
        results.append({"returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue()})
    tmp = result_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(results, f)
    os.replace(tmp, result_path)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the results are written: skip the interpreter's teardown of torch's modules (1-2 s)

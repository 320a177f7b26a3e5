"""Runs ``hybridflow`` command lines for the bad-input corpus, one forked child each.

``python -m tests.bad_inputs.runner`` imports the command line and everything its commands
import lazily (torch, the executor, ray) once, then reads one JSON request per line on stdin,
``{"argv": [...], "cwd": DIR, "timeout_seconds": S}``, and answers one JSON line on stdout,
``{"exit_code", "stdout", "stderr", "seconds", "timed_out"}``. Each request runs
``planner.cli.main`` in a child forked from this warm process, exactly as ``python -m planner``
would, so 200 cases cost seconds rather than 200 interpreter and torch start-ups.

A child that reaches ``ray.init`` has accepted its input as good: it fails loudly (exit 3,
"internal error") instead of starting a cluster, and the test names the case.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from typing import Any

NO_TRACEBACK_EXIT = 99
"""Exit code of a child whose exception escaped the command line's own handler."""


def _warm_imports() -> None:
    """Import what the commands import lazily, so each forked child starts warm."""
    import planner.calibration
    import planner.cli
    import planner.planning
    import planner.report  # noqa: F401
    import simulator.validation  # noqa: F401
    try:
        import datasets  # noqa: F401
        import ray
        import transformers  # noqa: F401

        import executor.data
        import executor.profiler
        import executor.run
        import executor.session  # noqa: F401
    except ImportError:  # a planner-only install: the corpus's executor cases say so
        return

    def refuse(*_args: Any, **_kwargs: Any) -> None:
        raise RuntimeError("the bad-input corpus reached ray.init: the input was accepted")

    ray.init = refuse


def _child(argv: list[str], cwd: str, out_path: str, err_path: str) -> None:
    """In the forked child: run the command line with stdout/stderr going to files."""
    os.setpgrp()  # so a timeout kills whatever the command started too
    code = 0
    try:
        os.chdir(cwd)
        out_fd = os.open(out_path, os.O_WRONLY)
        err_fd = os.open(err_path, os.O_WRONLY)
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        sys.stdout = open(1, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
        sys.stdin = open(os.devnull, encoding="utf-8")  # noqa: SIM115
        sys.argv = ["hybridflow", *argv]
        from planner.cli import main

        try:
            main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = NO_TRACEBACK_EXIT
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def run_one(argv: list[str], cwd: str, timeout_seconds: float) -> dict[str, Any]:
    """Fork, run ``argv``, wait at most ``timeout_seconds``, collect the outcome."""
    with tempfile.TemporaryDirectory(prefix="bad-input-") as scratch:
        out_path = os.path.join(scratch, "stdout")
        err_path = os.path.join(scratch, "stderr")
        for path in (out_path, err_path):
            open(path, "w").close()
        sys.stdout.flush()
        sys.stderr.flush()
        started = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            _child(argv, cwd, out_path, err_path)
        timed_out = False
        status = None
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.perf_counter() - started > timeout_seconds:
                timed_out = True
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
                _, status = os.waitpid(pid, 0)
                break
            time.sleep(0.005)
        seconds = time.perf_counter() - started
        exit_code = os.waitstatus_to_exitcode(status) if status is not None else None
        with open(out_path, encoding="utf-8", errors="replace") as handle:
            stdout = handle.read()
        with open(err_path, encoding="utf-8", errors="replace") as handle:
            stderr = handle.read()
    return {"exit_code": exit_code, "stdout": stdout, "stderr": stderr, "seconds": seconds,
            "timed_out": timed_out}


def main() -> None:
    sys.dont_write_bytecode = True  # a user's reward module leaves no __pycache__ in the sandbox
    os.environ.pop("HYBRIDFLOW_DEBUG", None)
    os.environ.pop("HYBRIDFLOW_PROFILE_PATH", None)
    _warm_imports()
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8")
    print(json.dumps({"ready": True}), file=replies, flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        reply = run_one(request["argv"], request["cwd"], request["timeout_seconds"])
        print(json.dumps(reply), file=replies, flush=True)


if __name__ == "__main__":
    main()

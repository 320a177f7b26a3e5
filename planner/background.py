"""Work run beside the caller: a function started now in a forked child process, its value (or
its exception) collected later. ``plan`` uses it to search the asynchronous modes while the
synchronous search runs, and to search while it imports the report's libraries (matplotlib and
pandas take about a second). Where a fork does not pay or is not safe, the function runs inline
when its result is asked for, so the work and its order are those of a plain call."""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading
import traceback
from collections.abc import Callable
from types import TracebackType
from typing import Any, Generic, TypeVar

T = TypeVar("T")

SERIAL_ENV = "HYBRIDFLOW_SERIAL"
"""Set to 1 to run every background job inline (one process, one core)."""


def fork_pays() -> bool:
    """Whether a forked child can run beside this process: Linux (macOS lists fork but its
    system libraries are not safe in a forked child, which is why Python spawns there), a
    second CPU to run on, one thread here (a fork copies only the calling thread, and a lock
    another thread holds stays held in the child: Ray's threads, say), and
    ``HYBRIDFLOW_SERIAL`` unset."""
    if os.environ.get(SERIAL_ENV, "") not in ("", "0"):
        return False
    if not sys.platform.startswith("linux"):
        return False
    if threading.active_count() > 1:
        return False
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (cpus or 1) > 1


class Background(Generic[T]):
    """``function(*args, **kwargs)``, started in a forked child process when ``fork`` (default:
    ``fork_pays()``), else run inline by ``result()``. Use it as a context manager: leaving
    the block before ``result()`` (an error on the caller's side) ends the child."""

    def __init__(self, function: Callable[..., T], /, *args: Any, fork: bool | None = None,
                 **kwargs: Any):
        self._call = (function, args, kwargs)
        self._process: Any = None
        self._reader: Any = None
        if fork if fork is not None else fork_pays():
            context = multiprocessing.get_context("fork")
            self._reader, writer = context.Pipe(duplex=False)
            # What this process has buffered would otherwise be written again by the child.
            for stream in (sys.stdout, sys.stderr):
                if stream is not None:
                    stream.flush()
            self._process = context.Process(target=_run_and_send,
                                            args=(self._reader, writer, self._call),
                                            name=getattr(function, "__name__", "background"))
            self._process.start()
            writer.close()  # the child's copy alone: a child that dies gives EOF here

    @property
    def forked(self) -> bool:
        """Whether the work runs in a child process."""
        return self._process is not None

    def result(self) -> T:
        """The function's value; its exception, raised here, if it raised one. Once only."""
        function, args, kwargs = self._call
        self._call = (_already_collected, (), {})
        if self._process is None:
            return function(*args, **kwargs)
        process, self._process = self._process, None
        try:
            kind, payload = self._reader.recv()
        except EOFError:
            kind, payload = "died", None
        finally:
            self._reader.close()
            process.join()
        if kind == "died":
            raise RuntimeError(f"the background process running {process.name} ended "
                               f"without a result (exit code {process.exitcode})")
        if kind == "error":
            raise payload
        return payload

    def close(self) -> None:
        """End the child if its result was not collected."""
        if self._process is not None:
            self._process.terminate()
            self._process.join()
            self._reader.close()
            self._process = None

    def __enter__(self) -> Background[T]:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.close()


def _already_collected() -> Any:
    raise RuntimeError("a background result is collected once")


def _run_and_send(reader: Any, writer: Any, call: tuple) -> None:
    """The child: run the call, send ("value", its value) or ("error", its exception, with
    the child's traceback as a note) to the parent."""
    reader.close()
    function, args, kwargs = call
    try:
        outcome: tuple[str, Any] = ("value", function(*args, **kwargs))
    except BaseException as exc:  # every outcome goes back to the parent
        exc.add_note("in the background process:\n" + "".join(
            traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip())
        outcome = ("error", exc)
    try:
        writer.send(outcome)
    except BrokenPipeError:
        pass  # the parent has gone
    except Exception as exc:  # a value or error that does not pickle
        writer.send(("error", RuntimeError(
            f"{getattr(function, '__name__', 'background work')} returned what cannot be "
            f"sent back to the parent process: {type(exc).__name__}: {exc}")))
    finally:
        writer.close()

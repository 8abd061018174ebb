"""Process exit: close models left open and let communication threads finish first.

Note [Exit abort]
    A gloo worker thread (or NCCL's watchdog) releases each finished ``Work`` shortly
    after the thread waiting on it was woken. If Python had already dropped the
    collective's tensor, that release frees the tensor's Python object, which needs the
    GIL. Once the interpreter is finalizing, Python makes any thread that asks for the
    GIL exit (``pthread_exit``); the forced unwind through the C++ worker loop ends in
    ``std::terminate``: "terminate called without an active exception", SIGABRT, after
    the script's last line. Backtrace (a benchmark rank, torch 2.13.0, Python 3.11.7):
    ``ProcessGroupGloo::runLoop -> ~AsyncAllreduceWork -> ~vector<Tensor> ->
    TensorImpl::decref_pyobject -> THPVariable_dealloc -> PyEval_RestoreThread ->
    take_gil -> PyThread_exit_thread -> pthread_exit -> std::terminate``, while the main
    thread was in ``Py_FinalizeEx``'s garbage collection. The threads outlive
    ``destroy_process_group()`` while anything still references the group (a DDP model
    keeps them alive to the end). Upstream: pytorch#190489 (open), pytorch#179291 (an
    atexit destroy, abandoned).

    ``atexit`` handlers run before finalization, with Python whole. This one is registered
    by the first ``wrap`` of the process (``track``), not at import: a process that never
    wraps a model runs nothing of ours at exit. It stays registered after the last model
    closes, since the threads it waits for outlive the models (a DDP model keeps its group);
    with no model open and no communication thread alive it returns at once. It closes open
    models (telemetry flushed, hooks removed), then, while torch communication threads
    are alive, leaves the GIL free: one slice, then more for as long as any of them is
    runnable (a thread the scheduler preempted right after finishing a collective), up
    to ``EXIT_GRACE_MAX_S``. Idle threads wait on a condition variable and cost nothing.
"""

from __future__ import annotations

import atexit
import logging
import os
import time
import weakref
from typing import Protocol

from .. import _torch_compat as compat

__all__ = ["EXIT_GRACE_MAX_S", "EXIT_GRACE_S", "communication_threads", "open_models", "track", "untrack"]

log = logging.getLogger(__name__)

#: The exit handler leaves the GIL free at least this long, and at most ``EXIT_GRACE_MAX_S``.
EXIT_GRACE_S = 0.01
EXIT_GRACE_MAX_S = 1.0


class _Closable(Protocol):
    def close(self) -> None: ...


_open: weakref.WeakSet[_Closable] = weakref.WeakSet()
_tracked_any = False  # set by the first track(), which registers the exit handler


def track(model: _Closable) -> None:
    """Close ``model`` at interpreter exit unless it was closed before (``untrack``).

    Example:
        >>> # track(model)   # DistCompiledModule.__init__ does this
    """
    global _tracked_any
    if not _tracked_any:
        atexit.register(_before_finalization)
        _tracked_any = True
    _open.add(model)


def open_models() -> list[_Closable]:
    """The models tracked and not closed yet, in no particular order.

    Example:
        >>> isinstance(open_models(), list)
        True
    """
    return list(_open)


def untrack(model: _Closable) -> bool:
    """Forget ``model`` (it was closed); whether it was still tracked (its first close)."""
    tracked = model in _open
    _open.discard(model)
    return tracked


def communication_threads() -> tuple[int, int] | None:
    """(alive, runnable) torch communication threads of this process; ``None`` without ``/proc``.

    Example:
        >>> found = communication_threads(); found is None or found[0] >= found[1] >= 0
        True
    """
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    alive = runnable = 0
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # the thread ended meanwhile
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        if name.startswith(compat.COMM_THREAD_PREFIXES):
            alive += 1
            runnable += stat[stat.rindex(")") + 2] == "R"
    return alive, runnable


def _before_finalization() -> None:
    for model in list(_open):
        try:
            model.close()
        except Exception:  # noqa: BLE001 - exiting anyway; say what was not flushed
            log.warning("closing a distcompile model at exit failed", exc_info=True)
    found = communication_threads()
    if found is None:  # no /proc: a fixed grace (a model was used: this handler is registered)
        time.sleep(0.1)
        return
    if not found[0]:
        return
    deadline = time.monotonic() + EXIT_GRACE_MAX_S
    time.sleep(EXIT_GRACE_S)
    while time.monotonic() < deadline and (communication_threads() or (0, 0))[1]:
        time.sleep(0.002)

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

    ``atexit`` handlers run before finalization, with Python whole: this one closes open
    models (telemetry flushed, hooks removed), then, if torch communication threads are
    alive, sleeps briefly so a thread still releasing a finished collective gets the GIL
    in time.
"""

from __future__ import annotations

import atexit
import logging
import os
import time
import weakref
from typing import Protocol

__all__ = ["EXIT_GRACE_S", "communication_threads", "track", "untrack"]

log = logging.getLogger(__name__)

#: Seconds the exit handler leaves the GIL to torch's communication threads.
EXIT_GRACE_S = 0.1
#: Thread names torch gives its communication threads (gloo work loop and transport, NCCL).
_COMM_THREAD_PREFIXES = ("pt_gloo", "gloo_", "pt_nccl")


class _Closable(Protocol):
    def close(self) -> None: ...


_open: weakref.WeakSet[_Closable] = weakref.WeakSet()
_tracked_any = False


def track(model: _Closable) -> None:
    """Close ``model`` at interpreter exit unless it was closed before (``untrack``).

    Example:
        >>> # track(model)   # DistCompiledModule.__init__ does this
    """
    global _tracked_any
    _tracked_any = True
    _open.add(model)


def untrack(model: _Closable) -> None:
    """Forget ``model`` (it was closed)."""
    _open.discard(model)


def communication_threads() -> int | None:
    """How many torch communication threads are alive (``None`` where ``/proc`` is absent).

    Example:
        >>> n = communication_threads(); n is None or n >= 0
        True
    """
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    n = 0
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                n += f.read().startswith(_COMM_THREAD_PREFIXES)
        except OSError:
            continue  # the thread ended meanwhile
    return n


@atexit.register
def _before_finalization() -> None:
    for model in list(_open):
        try:
            model.close()
        except Exception:  # noqa: BLE001 - exiting anyway; say what was not flushed
            log.warning("closing a distcompile model at exit failed", exc_info=True)
    threads = communication_threads()
    if threads or (threads is None and _tracked_any):
        time.sleep(EXIT_GRACE_S)

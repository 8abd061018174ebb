"""Inductor's one-time checks of the CPU's vector instruction sets: run them in an order of
distcompile's choosing, remember which libraries they built and which loaded, so that
ranks split them and folders filled from another skip them (Note [Sharing compiles
between ranks], ``compile/cpu_checks.py``)."""

from __future__ import annotations

import contextlib
import functools
import glob
import os
from collections.abc import Iterator

__all__ = ["ISA_LIBRARIES", "LOADED", "cpu_isa_checks", "run_cpu_isa_check", "vector_flags"]


def cpu_isa_checks() -> list:
    """Inductor's one-time checks of this CPU's vector instruction sets, in its order; [] once run.

    Before it generates its first C++ kernel, Inductor builds and loads a small library
    for each instruction set the CPU reports (AMX, AVX-512 VNNI, AVX-512, AVX2), each
    more extended one after the checks of the sets it extends: about 1.7 s of compiler
    for the first library of each, 0.35 s for each further one, under a file lock in its
    cache folder, so that the ranks of a machine would wait for them in turn. Each item
    is run with :func:`run_cpu_isa_check`, which builds what no other process has built
    and loads the rest. Empty when already run in this process, on CPUs other than x86,
    or when ``config.cpp.vec_isa_ok`` skips the checks. Checked: 2.13, 2.15
    (``torch._inductor.cpu_vec_isa``: ``supported_vec_isa_list``, ``x86_isa_checker``,
    ``valid_vec_isa_list``; ``bool(isa)`` runs the checks once and remembers them).

    Example:
        >>> len(cpu_isa_checks()) <= 6
        True
    """
    import platform

    from torch._inductor import config
    from torch._inductor import cpu_vec_isa as vec

    if platform.machine() not in ("x86_64", "AMD64") or config.cpp.vec_isa_ok is not None:
        return []
    try:
        if vec.valid_vec_isa_list.cache_info().currsize:  # checked already
            return []
        flags = vec.x86_isa_checker()
        return [isa for isa in vec.supported_vec_isa_list if all(f in flags for f in str(isa).split())]
    except AttributeError:  # another layout: Inductor runs its checks itself, unsplit
        return []


#: The libraries :func:`run_cpu_isa_check` found built (``kernel_libraries`` ships them too).
ISA_LIBRARIES: set[str] = set()
#: What a check library's name ends in once it loaded in a process of its own (its mark).
LOADED = ".load_ok"


@functools.cache
def vector_flags() -> str:
    """The vector-instruction flags Inductor's CPU checks read (``/proc/cpuinfo`` on x86),
    space-separated; ``""`` elsewhere. Checked: 2.13, 2.15 (``cpu_vec_isa.x86_isa_checker``).

    Example:
        >>> isinstance(vector_flags(), str)
        True
    """
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        return ""
    try:
        from torch._inductor import cpu_vec_isa as vec

        return " ".join(sorted(vec.x86_isa_checker()))
    except (ImportError, AttributeError, OSError):  # another layout: the checks then load as they are
        return "unknown"


def run_cpu_isa_check(isa: object) -> bool:
    """Run the checks of one item of :func:`cpu_isa_checks`; whether the set works.

    Each check builds a small library once (kept in Inductor's cache) and then, in every
    new process, loads it in a new Python process (about 0.15 s each, ten in all on an
    AVX-512 machine: 1.1-1.7 s of every warm start on 2 cores). A library that loaded
    once is not loaded again here: a ``.load_ok`` file beside it says so, the file and
    the rule Inductor itself uses from torch 2.15 on (where this adds nothing). The
    library's name holds the hash of its code, compiler version, flags and torch
    version, so a change of any of them loads a new library. The libraries are recorded
    (``ISA_LIBRARIES``) for ``kernel_libraries``, which ships them with their marks to
    folders that lack them. Checked: 2.13, 2.15 (``VecISA._probe_load(path)``, called by
    ``check_build`` under its lock); 2.11 loads inside ``check_build`` (no ``_probe_load``):
    its checks run as they are, loads included.

    Example:
        >>> # for isa in cpu_isa_checks(): run_cpu_isa_check(isa)
    """
    probe = getattr(type(isa), "_probe_load", None)

    def load(path: str) -> bool:
        marker = path + LOADED
        if os.path.isfile(marker):
            return True
        ok = probe(isa, path)
        if ok:
            with contextlib.suppress(OSError):  # a read-only cache: load again next time
                open(marker, "w").close()
        return ok

    sources: list[tuple[str, str]] = []
    if probe is not None:  # else (2.11) Inductor's checks run as they are, loads included
        isa._probe_load = load  # type: ignore[attr-defined]  # this call only
    try:
        with _check_sources(sources):
            return bool(isa)
    finally:
        if probe is not None:
            del isa._probe_load  # type: ignore[attr-defined]
        ISA_LIBRARIES.update(p for key, src in sources for p in glob.glob(_library_pattern(key, src)))


def _library_pattern(key: str, source: str) -> str:
    return os.path.join(glob.escape(os.path.dirname(source)), glob.escape(key) + "*.so")


@contextlib.contextmanager
def _check_sources(seen: list[tuple[str, str]]) -> Iterator[None]:
    """Add to ``seen`` the (key, path) of each C++ source Inductor writes meanwhile: a check's
    library is built beside its source, named by its key, whether or not the check loads it
    (2.15 skips the load, and so :func:`run_cpu_isa_check`'s hook, where the mark is there).
    Checked: 2.13, 2.15 (``codecache.write`` imported by ``check_build`` at each call)."""
    from torch._inductor import codecache

    write = codecache.write

    def recorded(content: object, extension: str, *args: object, **kwargs: object) -> tuple[str, str]:
        key, path = write(content, extension, *args, **kwargs)
        if extension == "cpp":
            seen.append((key, path))
        return key, path

    codecache.write = recorded
    try:
        yield
    finally:
        codecache.write = write

"""Compiled artifacts out of and into PyTorch's compile caches (Note [Compiles shared across cache folders]).

``torch.compiler.save_cache_artifacts`` serializes the AOTAutograd and Inductor cache
entries a process wrote or read (with Triton kernels bundled on GPU), and
``load_cache_artifacts`` writes them into this process's caches. Inductor's C++ kernels
(CPU) are not in those entries: they are shared libraries in Inductor's cache folder,
named by a hash of their source and compile command, and Inductor compiles one only when
its file is absent. ``kernel_libraries`` lists the ones this process loaded.
"""

from __future__ import annotations

import glob
import logging
import os
import platform
import sys

import torch

from .cpu_checks import ISA_LIBRARIES, LOADED, vector_flags
from .dynamo import inductor_cache_dir

__all__ = ["build_fingerprint", "forget_artifacts", "kernel_libraries", "load_artifacts", "save_artifacts"]

log = logging.getLogger(__name__)


def save_artifacts() -> bytes:
    """Every compile-cache entry this process wrote or read so far, serialized by PyTorch
    (``b""`` when there is none, or the torch in use cannot serialize them).

    Example:
        >>> isinstance(save_artifacts(), bytes)
        True
    """
    try:
        out = torch.compiler.save_cache_artifacts()
    except Exception as exc:  # noqa: BLE001 - an optional speed-up: its failure costs a compile
        log.debug("torch.compiler.save_cache_artifacts failed: %s: %s", type(exc).__name__, exc)
        return b""
    return out[0] if out else b""


def forget_artifacts() -> None:
    """Make ``save_artifacts`` start over: what it returns next is what was written or read
    after this call. Checked: 2.13 (``torch.compiler._cache.CacheArtifactManager.clear``).

    Example:
        >>> forget_artifacts()
    """
    try:
        from torch.compiler._cache import CacheArtifactManager

        CacheArtifactManager.clear()
    except Exception as exc:  # noqa: BLE001 - publications then repeat earlier entries: bigger, not wrong
        log.debug("could not clear the compile-cache artifacts: %s: %s", type(exc).__name__, exc)


def load_artifacts(blob: bytes) -> int:
    """Write ``save_artifacts``' output into this process's compile caches; the number of
    entries written (0 when torch could not read them).

    Example:
        >>> load_artifacts(b"")
        0
    """
    if not blob:
        return 0
    info = torch.compiler.load_cache_artifacts(blob)
    if info is None:
        return 0
    kinds = ("inductor_artifacts", "aot_autograd_artifacts", "autotune_artifacts")
    return sum(len(getattr(info, k, ()) or ()) for k in kinds)


def _code_caches() -> list[type]:
    try:
        from torch._inductor.codecache import CppCodeCache
    except ImportError:  # pragma: no cover - a torch without Inductor's C++ backend
        return []
    found, todo = [], [CppCodeCache]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return found


def kernel_libraries() -> list[str]:
    """Paths, relative to Inductor's cache folder, of the C++ kernel libraries this process
    has loaded and of the libraries of Inductor's CPU checks it ran, with the ``.load_ok``
    marks of the checks that loaded (``run_cpu_isa_check``; ``[]`` where torch keeps them
    elsewhere). The marks travel with the libraries so that a folder filled from another
    spares the check's load in a new process (0.15 s each, ten on an AVX-512 machine); the
    fingerprint they travel under names the CPU's vector flags (``build_fingerprint``).

    Example:
        >>> isinstance(kernel_libraries(), list)
        True
    """
    root = inductor_cache_dir()
    keys = {
        k for cls in _code_caches() for k in getattr(cls, "cache", {}) if isinstance(k, str) and len(k) > 3
    }
    paths = {p for k in keys for p in glob.glob(os.path.join(root, k[1:3], glob.escape(k) + "*.so"))}
    paths |= {p for p in ISA_LIBRARIES if os.path.isfile(p)}  # the CPU checks' (run_cpu_isa_check)
    paths |= {p + LOADED for p in ISA_LIBRARIES if os.path.isfile(p + LOADED)}
    real = os.path.realpath(root)
    inside = [p for p in paths if os.path.commonpath([real, os.path.realpath(p)]) == real]
    return sorted(os.path.relpath(os.path.realpath(p), real) for p in inside)


def build_fingerprint() -> dict[str, str]:
    """What compiled artifacts depend on beyond their own cache keys: torch, Python, the
    machine, its C++ compiler and vector instructions (ATen's pick and the flags Inductor's
    CPU checks read: a check that loaded there loads here), CUDA and the GPU, Triton.

    Example:
        >>> build_fingerprint()["torch"] == torch.__version__
        True
    """
    out = {
        "torch": torch.__version__,
        "torch_git": str(getattr(torch.version, "git_version", "")),
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "cuda": str(torch.version.cuda),
    }
    # ATen's view of the vector instructions (Inductor's own pick would build its check
    # libraries first: seconds on a fresh cache folder); the kernels' keys name theirs too.
    out["cpu_isa"] = torch.backends.cpu.get_cpu_capability()
    out["cpu_flags"] = vector_flags()
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        out["cxx"] = os.path.basename(str(get_cpp_compiler()))
    except Exception:  # noqa: BLE001
        out["cxx"] = ""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        out["gpu"] = f"{props.name} sm_{props.major}{props.minor}"
        try:
            out["driver"] = str(torch._C._cuda_getDriverVersion())
        except Exception:  # noqa: BLE001
            out["driver"] = ""
        try:
            import triton

            out["triton"] = triton.__version__
        except ImportError:
            out["triton"] = ""
    return out

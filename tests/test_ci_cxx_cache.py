"""`.ci/cxx-cache`, the compiler-call cache `.ci/run` puts before g++: a repeat gets the library
built before, anything that differs (source, flags, an included header) is compiled again."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / ".ci" / "cxx-cache"
# Under .ci/run, "g++" on PATH is the cache itself: the compiler is the one it names.
REAL = os.environ.get("DISTCOMPILE_CI_REAL_CXX") or shutil.which("g++")
pytestmark = pytest.mark.skipif(REAL is None, reason="no g++ on this machine")

SOURCE = 'extern "C" int value() { return VALUE + EXTRA; }\n'  # EXTRA: from the -include'd header


def _compile(
    tmp: Path, folder: str, cache: Path, *flags: str, header: str = "#define EXTRA 0\n"
) -> tuple[subprocess.CompletedProcess, Path]:
    src_dir = tmp / folder
    src_dir.mkdir(exist_ok=True)
    (src_dir / "value.h").write_text(header)
    (src_dir / "k.cpp").write_text(SOURCE)
    out = src_dir / "k.so"
    env = {**os.environ, "DISTCOMPILE_CI_REAL_CXX": REAL, "DISTCOMPILE_CI_CXX_CACHE": str(cache)}
    # As Inductor calls it: source and header in a folder of their own, compiled and linked at once.
    args = [str(src_dir / "k.cpp"), "-include", str(src_dir / "value.h"), "-shared", "-fPIC", *flags]
    proc = subprocess.run([sys.executable, str(SCRIPT), *args, "-o", str(out)], env=env, capture_output=True)
    return proc, out


def _value(lib: Path) -> int:
    return ctypes.CDLL(str(lib)).value()


def _log(cache: Path) -> list[str]:
    return [line.split()[0] for line in (cache / "calls.log").read_text().splitlines()]


def test_a_repeat_is_answered_from_the_cache_and_anything_different_is_compiled(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    first, lib1 = _compile(tmp_path, "a", cache, "-DVALUE=1")
    again, lib2 = _compile(tmp_path, "b", cache, "-DVALUE=1")  # same source and flags, another folder
    assert first.returncode == again.returncode == 0, (first.stderr, again.stderr)
    assert _log(cache) == ["miss", "hit"]
    assert lib1.read_bytes() == lib2.read_bytes() and _value(lib2) == 1
    flag, lib3 = _compile(tmp_path, "c", cache, "-DVALUE=2")
    header, lib4 = _compile(tmp_path, "d", cache, "-DVALUE=2", header="#define EXTRA 40\n")
    assert flag.returncode == header.returncode == 0
    assert _log(cache) == ["miss", "hit", "miss", "miss"]
    assert _value(lib3) == 2 and _value(lib4) == 42


def test_a_failed_compile_keeps_its_error_and_caches_nothing(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    proc, out = _compile(tmp_path, "a", cache)  # VALUE undefined
    assert proc.returncode != 0 and b"VALUE" in proc.stderr and not out.exists()
    assert not (cache / "calls.log").exists() and not list(cache.iterdir())


def test_other_calls_and_an_unset_cache_run_the_compiler_itself(tmp_path: Path) -> None:
    env = {**os.environ, "DISTCOMPILE_CI_REAL_CXX": REAL, "DISTCOMPILE_CI_CXX_CACHE": str(tmp_path)}
    version = subprocess.run(
        [sys.executable, str(SCRIPT), "--version"], env=env, capture_output=True, text=True
    )
    assert (
        version.returncode == 0
        and version.stdout == subprocess.run([REAL, "--version"], capture_output=True, text=True).stdout
    )
    assert not list(tmp_path.iterdir())
    env.pop("DISTCOMPILE_CI_CXX_CACHE")
    (tmp_path / "k.cpp").write_text('extern "C" int value() { return 7; }\n')
    args = [str(tmp_path / "k.cpp"), "-shared", "-fPIC", "-o", str(tmp_path / "k.so")]
    assert subprocess.run([sys.executable, str(SCRIPT), *args], env=env).returncode == 0
    assert _value(tmp_path / "k.so") == 7


def test_the_cache_named_as_its_own_compiler_refuses_instead_of_calling_itself(tmp_path: Path) -> None:
    env = {**os.environ, "DISTCOMPILE_CI_REAL_CXX": str(SCRIPT), "DISTCOMPILE_CI_CXX_CACHE": str(tmp_path)}
    (tmp_path / "k.cpp").write_text('extern "C" int value() { return 7; }\n')
    args = [str(tmp_path / "k.cpp"), "-shared", "-o", str(tmp_path / "k.so")]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 2 and "is this script" in proc.stderr, proc.stderr

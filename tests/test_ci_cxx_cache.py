"""`.ci/cxx-cache`, the compiler-call cache `.ci/run` puts before g++: a repeat gets the library
built before, anything that differs (source, flags, an included header, the release of the
package whose headers it includes) is compiled again."""

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


def _env(cache: Path | None, real: str | None = REAL) -> dict[str, str]:
    """The cache's environment; its log in ``cache/calls.log`` (under .ci/run, not the run's)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTCOMPILE_CI_CXX")}
    env["DISTCOMPILE_CI_REAL_CXX"] = str(real)
    if cache is not None:
        env["DISTCOMPILE_CI_CXX_CACHE"] = str(cache)
    return env


def _compile(
    tmp: Path, folder: str, cache: Path, *flags: str, header: str = "#define EXTRA 0\n"
) -> tuple[subprocess.CompletedProcess, Path]:
    src_dir = tmp / folder
    src_dir.mkdir(exist_ok=True)
    (src_dir / "value.h").write_text(header)
    (src_dir / "k.cpp").write_text(SOURCE)
    out = src_dir / "k.so"
    # As Inductor calls it: source and header in a folder of their own, compiled and linked at once.
    args = [str(src_dir / "k.cpp"), "-include", str(src_dir / "value.h"), "-shared", "-fPIC", *flags]
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args, "-o", str(out)], env=_env(cache), capture_output=True
    ), out


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
    env = _env(tmp_path)
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
    env = _env(tmp_path, real=str(SCRIPT))
    (tmp_path / "k.cpp").write_text('extern "C" int value() { return 7; }\n')
    args = [str(tmp_path / "k.cpp"), "-shared", "-o", str(tmp_path / "k.so")]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 2 and "is this script" in proc.stderr, proc.stderr


def test_a_package_released_again_in_place_is_compiled_again_and_hits_mark_entries_used(
    tmp_path: Path,
) -> None:
    """The cache outlives a run: an include folder's package (torch, upgraded in the same
    site-packages) names its release in ``version.py``; the headers under it are not hashed."""
    cache = tmp_path / "cache"
    cache.mkdir()
    pkg = tmp_path / "site" / "fakepkg"
    (pkg / "include").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "include" / "extra.h").write_text("#define EXTRA 0\n")
    flags = ("-DVALUE=1", f"-I{pkg / 'include'}")
    header = '#include "extra.h"\n'  # found through -I, as torch's headers are
    (pkg / "version.py").write_text("__version__ = '1.0'\n")
    first, _ = _compile(tmp_path, "a", cache, *flags, header=header)
    again, _ = _compile(tmp_path, "b", cache, *flags, header=header)
    assert first.returncode == again.returncode == 0, (first.stderr, again.stderr)
    (entry,) = [e for e in cache.iterdir() if e.suffix not in (".log", ".cpu")]
    os.utime(entry, (1, 1))
    _compile(tmp_path, "c", cache, *flags, header=header)
    assert entry.stat().st_mtime > 1  # a hit marks its entry used: .ci/run drops unused ones
    (pkg / "include" / "extra.h").write_text("#define EXTRA 40\n")
    (pkg / "version.py").write_text("__version__ = '1.1'\n")
    upgraded, lib = _compile(tmp_path, "d", cache, *flags, header=header)
    assert upgraded.returncode == 0 and _value(lib) == 41
    assert _log(cache) == ["miss", "hit", "hit", "miss"]

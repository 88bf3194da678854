"""Building the CPU's C kernels (cpu/csrc/) for this CPU, once, and loading them.

The C sources have no Python or torch headers, so they compile in about a second with
the system's C compiler. The shared object is cached under the cache folder, keyed by
the source, the flags and this CPU's feature flags (it is built with -march=native).
Without a compiler, callers fall back to the pure-torch path; that choice is logged.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

from common.config import cache_dir
from engine_worker.cpu.kernels import CpuKernels

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = sorted(_CSRC.glob("*.c"))
_HEADERS = sorted(_CSRC.glob("*.h"))
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC"]

loaded: dict[str, Optional[CpuKernels]] = {}


def cpu_kernels() -> Optional[CpuKernels]:
    """The compiled kernels, or None when they cannot be built here."""
    if "cpu" not in loaded:
        loaded["cpu"] = build_and_load(_extra_flags)
    return loaded["cpu"]


def _cpuinfo(field: str) -> str:
    """The first /proc/cpuinfo line of ``field`` ("" where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(field)), "")
    except OSError:
        return ""


def _cpu_signature() -> str:
    return platform.machine() + _cpuinfo("flags")


@functools.lru_cache(maxsize=None)
def vendor_flags() -> tuple[str, ...]:
    """-DRS_INTEL on Intel CPUs: their float tiles fetch the next panel into L2, not
    L1, and without AMX their bfloat16 weights are widened, not multiplied with
    vdpbf16ps (gemm.c)."""
    return ("-DRS_INTEL",) if "GenuineIntel" in _cpuinfo("vendor_id") else ()


def build_flags(extra_flags: Sequence[str]) -> list[str]:
    """The compiler's flags: the standard ones, the vendor's, then ``extra_flags``."""
    return [*_FLAGS, *vendor_flags(), *extra_flags]


def link_flags(flags: Sequence[str]) -> list[str]:
    """The link's flags: the build's, without -ffast-math, for which GCC would add its
    start-up code that sets flush-to-zero for the whole process loading the library
    (the kernels set it in their own threads: kernels.h's RS_FAST_MODES)."""
    return [f for f in flags if f != "-ffast-math"]


def _find_compiler() -> Optional[str]:
    """$CC if it names a program that exists, else cc or gcc on the PATH."""
    named = os.environ.get("CC")
    if named:
        found = shutil.which(named.split()[0])
        if found is not None:
            return found
        logger.warning("CC=%s names no program on this machine; looking for cc or gcc", named)
    return shutil.which("cc") or shutil.which("gcc")


_extra_flags: list[str] = []


def use_extra_flags(flags: list[str]) -> None:
    """Build the kernels with these compiler flags too (before the first use), e.g.
    ["-mno-avx512f"] to measure the AVX2 path on an AVX-512 machine (benchmarks)."""
    _extra_flags[:] = flags
    loaded.pop("cpu", None)


def cached_path(extra_flags: Sequence[str] = ()) -> Path:
    """Where the kernels built from this source, with the standard flags plus
    ``extra_flags`` (as compiled and as linked), for this CPU are cached."""
    source = b"".join(p.read_bytes() for p in _SOURCES + _HEADERS)
    flags = build_flags(extra_flags)
    key = hashlib.sha256(source + " ".join(flags).encode() + b" | "
                         + " ".join(link_flags(flags)).encode() + _cpu_signature().encode())
    return Path(cache_dir()) / "kernels" / f"roseserve-kernels-{key.hexdigest()[:16]}.so"


def _compile(compiler: str, flags: list[str], out: Path) -> Optional[tuple[str, str]]:
    """Build the library ``out``: every source compiled at once, each by its own
    process, then linked (gemm.c and paged_attention.c take 6 and 10 s on a Xeon: 10
    s on two cores where one command took 16). The failing command and its complaint,
    or None."""
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        objects = [str(Path(tmp) / f"{source.stem}.o") for source in _SOURCES]
        compiles = [[compiler, *(f for f in flags if f != "-shared"), "-c", str(source),
                     "-o", obj] for source, obj in zip(_SOURCES, objects)]
        jobs: list[subprocess.Popen] = []
        try:
            for cmd in compiles:
                jobs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                                             stderr=subprocess.PIPE, text=True))
            for cmd, job in zip(compiles, jobs):
                _, error = job.communicate()
                if job.returncode != 0:
                    return " ".join(cmd), error.strip()
            link = [compiler, *link_flags(flags), *objects, "-o", str(out), "-lm"]
            result = subprocess.run(link, capture_output=True, text=True)
        except OSError as e:  # the compiler vanished, or is not executable
            return compiler, str(e)
        finally:   # the others, when one failed
            for job in jobs:
                if job.poll() is None:
                    job.kill()
                    job.wait()
        return (" ".join(link), result.stderr.strip()) if result.returncode != 0 else None


def _build(compiler: str, extra_flags: Sequence[str], target: Path) -> bool:
    logger.info("building the CPU kernels for this CPU, once (cached in %s)", target.parent)
    started = time.monotonic()
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        failed = _compile(compiler, build_flags(extra_flags), Path(tmp))
        if failed is None:
            os.replace(tmp, target)  # atomic: a reader never sees half a file
    finally:   # failed, or stopped (roseserve serve ends its build with SIGTERM)
        if os.path.exists(tmp):
            os.unlink(tmp)
    if failed is not None:
        logger.warning("building the CPU kernels failed (%s): using the torch path\n%s",
                       *failed)
        return False
    logger.info("built the CPU kernels in %.1f s", time.monotonic() - started)
    return True


def build_and_load(extra_flags: Sequence[str] = ()) -> Optional[CpuKernels]:
    """Build (or find in the cache) and load the kernels, compiled with the standard
    flags plus ``extra_flags``."""
    compiler = _find_compiler()
    if compiler is None:
        logger.warning("no C compiler found: CPU attention uses the slower torch path")
        return None
    target = cached_path(extra_flags)
    out_dir = target.parent
    if not target.is_file():
        out_dir.mkdir(parents=True, exist_ok=True)
        # One build at a time: a process that finds another building waits for it
        # (engines started together; roseserve serve's build during a first start)
        with open(target.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not target.is_file() and not _build(compiler, extra_flags, target):
                return None
    try:
        return CpuKernels(ctypes.CDLL(str(target)))
    except OSError as e:
        logger.warning("loading %s failed (%s): using the torch path", target, e)
        return None

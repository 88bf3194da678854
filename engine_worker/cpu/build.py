"""Building the CPU's C kernels (cpu/csrc/) for this CPU, once, and loading them.

The C sources have no Python or torch headers, so they compile in about a second with
the system's C compiler. The shared object is cached under the cache folder, keyed by
the source, the flags and this CPU's feature flags (it is built with -march=native);
so are its objects (under kernels/objects), by what each is compiled from, which builds
with other flags share where these change nothing in a source (the tests build some 20).
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
from typing import Any, NamedTuple, Optional, Sequence

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


def _objects_dir() -> Path:
    return Path(cache_dir()) / "kernels" / "objects"


def _key_flags(flags: Sequence[str], target_options: str) -> list[str]:
    """Of a compile's flags, those its object's cache key names: not -D or -U, whose
    effect the preprocessed source shows, nor an -m switch whose effect the compiler's
    resolved target options show (-mno-amx-tile on a CPU without AMX changes nothing:
    the same object)."""
    listed = {line.split()[0] for line in target_options.splitlines()
              if line.lstrip().startswith("-m")}

    def shown(f: str) -> bool:
        return f.startswith("-m") and "=" not in f and "-m" + f[2:].removeprefix("no-") in listed
    return [f for f in flags if not ((f[:2] in ("-D", "-U") and len(f) > 2) or shown(f))]


@functools.lru_cache(maxsize=None)
def _compiler_id(compiler: str) -> bytes:
    try:
        return subprocess.run([compiler, "--version"], capture_output=True).stdout
    except OSError:
        return b""


class _Job(NamedTuple):
    cmd: list[str]
    source: str = ""   # the source it compiles (timed, to start the longest first)
    stdout: Optional[str] = None   # the file its output goes to


# How long each source took to compile in this process
_seconds: dict[str, float] = {}


def _run_all(jobs: list[_Job], parallel: Optional[int],
             stop_at_failure: bool) -> dict[int, tuple[str, str]]:
    """Run the commands, ``parallel`` at a time (None: all at once), the sources that
    took longest to compile first. Those that failed (by index: the command and its
    complaint); with ``stop_at_failure``, the first one, the others stopped."""
    queue = list(range(len(jobs)))
    running: list[tuple[int, subprocess.Popen, Any, float]] = []
    failed: dict[int, tuple[str, str]] = {}
    try:
        while queue or running:
            while queue and len(running) < (parallel or len(jobs)):
                i = max(queue, key=lambda j: _seconds.get(jobs[j].source, float("inf")))
                queue.remove(i)
                err = tempfile.TemporaryFile()
                out = open(jobs[i].stdout, "wb") if jobs[i].stdout else subprocess.DEVNULL
                try:
                    running.append((i, subprocess.Popen(jobs[i].cmd, stdout=out, stderr=err),
                                    err, time.monotonic()))
                except OSError as e:  # the compiler vanished, or is not executable
                    err.close()
                    failed[i] = jobs[i].cmd[0], str(e)
                    if stop_at_failure:
                        return failed
                finally:
                    if jobs[i].stdout:
                        out.close()
            done = [r for r in running if r[1].poll() is not None]
            if not done:
                time.sleep(0.02)
            for job in done:
                running.remove(job)
                i, proc, err, started = job
                if proc.returncode != 0:
                    err.seek(0)
                    failed[i] = (" ".join(jobs[i].cmd),
                                 err.read().decode(errors="replace").strip())
                elif jobs[i].source:
                    _seconds[jobs[i].source] = time.monotonic() - started
                err.close()
                if proc.returncode != 0 and stop_at_failure:
                    return failed
        return failed
    finally:   # the others, when one failed or this process was stopped
        for _, proc, err, _ in running:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            err.close()


def _objects(compiler: str, flag_lists: Sequence[list[str]], parallel: Optional[int],
             stop_at_failure: bool) -> list[Any]:
    """For each build's flags, its objects (in _SOURCES' order), or the command that
    failed and its complaint. An object is cached by what it is compiled from: the
    source as the flags preprocess it, the flags that are not the preprocessor's, and
    the target options they leave on, so builds that differ only in macros a source
    does not read, or in instructions this CPU lacks anyway, share it. Each missing
    object is compiled once, ``parallel`` at a time (None: all at once)."""
    out = _objects_dir()
    results: list[Any] = []
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        def compile_cmd(flags: list[str]) -> list[str]:
            return [compiler, *(f for f in flags if f != "-shared")]

        # a compiler without -Q --help=target (not GCC): each -m flag in the keys
        target_failed = _run_all([_Job(compile_cmd(flags) + ["-Q", "--help=target"],
                                       stdout=f"{tmp}/{b}.target")
                                  for b, flags in enumerate(flag_lists)], parallel, False)
        preprocess = [_Job(compile_cmd(flags) + ["-E", str(s), "-o", f"{tmp}/{b}-{s.stem}.i"])
                      for b, flags in enumerate(flag_lists) for s in _SOURCES]
        failed = _run_all(preprocess, parallel, stop_at_failure)
        compiles: dict[Path, _Job] = {}
        for b, flags in enumerate(flag_lists):
            complaints = [failed[i] for i in range(b * len(_SOURCES), (b + 1) * len(_SOURCES))
                          if i in failed]
            if complaints or (stop_at_failure and failed):
                results.append(complaints[0] if complaints else None)
                continue
            target = "" if b in target_failed else \
                Path(f"{tmp}/{b}.target").read_text(errors="replace")
            key_flags = " ".join(_key_flags(flags, target)).encode()
            objects = []
            for s in _SOURCES:
                key = hashlib.sha256(b"\0".join([
                    _compiler_id(compiler), _cpu_signature().encode(), key_flags,
                    target.encode(), Path(f"{tmp}/{b}-{s.stem}.i").read_bytes()]))
                obj = out / f"{s.stem}-{key.hexdigest()[:16]}.o"
                objects.append(obj)
                if not obj.is_file():
                    compiles.setdefault(obj, _Job(compile_cmd(flags) + [
                        "-c", str(s), "-o", f"{tmp}/{obj.name}"], s.name))
            results.append(objects)
        missing = list(compiles)
        failed = _run_all([compiles[obj] for obj in missing], parallel, stop_at_failure)
        for i, obj in enumerate(missing):
            if i not in failed and os.path.exists(f"{tmp}/{obj.name}"):
                out.mkdir(exist_ok=True)
                os.replace(f"{tmp}/{obj.name}", obj)  # atomic: never half an object
    for b, objects in enumerate(results):
        if isinstance(objects, list) and not all(obj.is_file() for obj in objects):
            results[b] = next((failed[i] for i, obj in enumerate(missing)
                               if obj in objects and i in failed), None)
    return results


def _compile(compiler: str, flags: list[str], out: Path) -> Optional[tuple[str, str]]:
    """Build the library ``out``: every source not in the cache of objects compiled at
    once, each by its own process, then linked (gemm.c and paged_attention.c take 6 and
    10 s on a Xeon: 10 s on two cores where one command took 16). The failing command
    and its complaint, or None."""
    objects = _objects(compiler, [flags], None, stop_at_failure=True)[0]
    if not isinstance(objects, list):
        return objects or (compiler, "the build stopped")
    link = [compiler, *link_flags(flags), *map(str, objects), "-o", str(out), "-lm"]
    try:
        result = subprocess.run(link, capture_output=True, text=True)
    except OSError as e:  # the compiler vanished, or is not executable
        return compiler, str(e)
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


def _built(compiler: str, extra_flags: Sequence[str], target: Path) -> bool:
    """Whether ``target`` is in the cache, built now if it was not."""
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        # One build at a time: a process that finds another building waits for it
        # (engines started together; roseserve serve's build during a first start)
        with open(target.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not target.is_file() and not _build(compiler, extra_flags, target):
                return False
    return True


def build_all(flag_lists: Sequence[Sequence[str]], parallel: Optional[int] = None) -> None:
    """Build into the cache the kernels with each of these extra flags that are not
    there yet, all together: every object they lack compiled once, ``parallel`` at a
    time (by default as many as this machine has cores), the longest first, then each
    linked. For the tests' many builds, which one at a time leave a core idle while
    the longest source compiles. A build that fails is left to build_and_load to
    report."""
    compiler = _find_compiler()
    pending = {cached_path(extra): list(extra) for extra in flag_lists}
    pending = {target: extra for target, extra in pending.items() if not target.is_file()}
    if compiler is None or not pending:
        return
    started = time.monotonic()
    next(iter(pending)).parent.mkdir(parents=True, exist_ok=True)
    objects = _objects(compiler, [build_flags(extra) for extra in pending.values()],
                       parallel or os.cpu_count(), stop_at_failure=False)
    for (target, extra), built in zip(pending.items(), objects):
        if isinstance(built, list):
            _built(compiler, extra, target)   # linked: its objects are in the cache
    logger.info("built %d variants of the CPU kernels in %.1f s", len(pending),
                time.monotonic() - started)


def build_and_load(extra_flags: Sequence[str] = ()) -> Optional[CpuKernels]:
    """Build (or find in the cache) and load the kernels, compiled with the standard
    flags plus ``extra_flags``."""
    compiler = _find_compiler()
    if compiler is None:
        logger.warning("no C compiler found: CPU attention uses the slower torch path")
        return None
    target = cached_path(extra_flags)
    if not _built(compiler, extra_flags, target):
        return None
    try:
        return CpuKernels(ctypes.CDLL(str(target)))
    except OSError as e:
        logger.warning("loading %s failed (%s): using the torch path", target, e)
        return None

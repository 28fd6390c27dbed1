"""The native CPU library: expeditor's C kernels, compiled once per machine.

One shared library from :data:`SOURCES` (the paged attention of
:mod:`gpu_worker.attention.native_backend`, the bf16 layer operations of
:mod:`gpu_worker.layer_ops`, and the vector helpers they share, ``cpu_vectors.h``).
The first worker on a machine compiles it with the system C compiler (``$CC``, else
``cc``/``gcc``/``clang``) into ``kernels/`` of expeditor's cache directory
(``$EXPEDITOR_CACHE_DIR``, else ``~/.cache/expeditor``), named by a hash of the sources,
flags, compiler and CPU, so later workers load it in milliseconds; a build is written
under a temporary name and renamed, so concurrent workers never load half a file.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

from shared.paths import cache_dir

__all__ = ["SOURCES", "Library", "build", "compiler", "library"]

_HERE = Path(__file__).parent
SOURCES = (_HERE / "paged_attention_cpu.c", _HERE / "layer_ops_cpu.c")
HEADERS = (_HERE / "cpu_vectors.h",)
FLAGS = ("-O3", "-fPIC", "-shared", "-fno-math-errno", "-fassociative-math")
FLAGS += ("-fno-signed-zeros", "-fno-trapping-math")
"""Reassociation lets the compiler vectorise the sums; infinities keep their meaning."""
TUNE = ("-march=native",)
"""Tried first (the kernels run where they are built); dropped if the compiler refuses."""
OPENMP = ("-fopenmp",)
"""Tried first, dropped if the compiler has no OpenMP. The library names
``libgomp.so.1``, which torch (GNU OpenMP on Linux) has loaded by then, so the kernels
run on torch's own thread pool: as many threads as ``torch.set_num_threads`` gave, and
the ones a matmul just left spinning, where a thread of the kernels' own would compete
with them for the cores."""


def compiler() -> str | None:
    """The C compiler a build would use (None: none found)."""
    names = (os.environ.get("CC"), "cc", "gcc", "clang")
    return next((c for c in names if c and shutil.which(c)), None)


def _run(command: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"{command[0]} did not run: {exc}") from None


def _cpu_id() -> bytes:
    """What ``-march=native`` compiled for: the machine, the CPU's model and feature flags."""
    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.exists() else []
    wanted = ("model name", "flags", "Features", "CPU part")
    kept = sorted({line for line in lines if line.startswith(wanted)})
    return "\n".join([platform.machine(), platform.processor(), *kept]).encode()


def build(directory: Path | None = None) -> Path:
    """The compiled library, built if this machine has none yet (``RuntimeError``: why not)."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (set CC, or install cc/gcc)")
    directory = directory or cache_dir() / "kernels"
    version = _run([cc, "--version"], 30).stdout.encode()
    code = b"\0".join([*(path.read_bytes() for path in (*SOURCES, *HEADERS)), version, _cpu_id()])
    errors = []
    for flags in ((*FLAGS, *OPENMP, *TUNE), (*FLAGS, *TUNE), FLAGS):
        key = b"\0".join([code, " ".join(flags).encode()])
        target = directory / f"expeditor_cpu-{hashlib.sha256(key).hexdigest()[:16]}.so"
        if target.exists():
            return target
        directory.mkdir(parents=True, exist_ok=True)
        fd, partial = tempfile.mkstemp(dir=directory, suffix=".so.partial")
        os.close(fd)
        try:
            sources = [str(path) for path in SOURCES]
            done = _run([cc, *flags, "-o", partial, *sources, "-lm"], 300)
            if done.returncode == 0:
                os.replace(partial, target)
                return target
            errors.append(f"{cc} {' '.join(flags)}: {done.stderr.strip()[-500:]}")
        finally:
            Path(partial).unlink(missing_ok=True)
    raise RuntimeError("the C compiler failed: " + " | ".join(errors))


class Library(NamedTuple):
    """The built library: its file, and the process's handle on it."""

    path: Path
    cdll: ctypes.CDLL


@functools.cache
def library() -> Library | str:
    """This process's library, built (:func:`build`) and loaded once for every user of
    it (the attention kernel, the layer operations), or why there is none."""
    try:
        path = build()
        return Library(path, ctypes.CDLL(str(path)))
    except (RuntimeError, OSError) as exc:
        return str(exc)

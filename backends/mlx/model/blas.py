"""Use the system OpenBLAS for MLX's CPU matmuls on Linux, by LD_PRELOAD.

Owns: finding Debian/Ubuntu's OpenBLAS, building a worker subprocess environment that preloads
it (or keeps it out), re-executing the current process with it, and reporting which BLAS this
process actually uses.

Why: the Linux `mlx[cpu]` wheel bundles the netlib reference BLAS (`mlx_cpu.libs/libblas-*.so`),
which is roughly an order of magnitude slower than OpenBLAS. The bundled library is linked by
soname-less path, so the only way to swap it without rebuilding MLX is to preload a library that
exports the same `cblas_*` symbols; the dynamic linker then resolves MLX's calls to it. On macOS
MLX uses Accelerate and nothing here applies.
"""

from __future__ import annotations

import os
import platform
import sys
import sysconfig
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

# Set in the environment of a process we re-executed, so it never re-executes again.
REEXEC_MARKER = "_PREFIXD_BLAS_REEXEC"


def _lib_dirs() -> list[Path]:
    triplet = sysconfig.get_config_var("MULTIARCH") or f"{platform.machine()}-linux-gnu"
    return [Path("/usr/lib") / triplet, Path("/usr/lib64"), Path("/usr/lib")]


def find_openblas() -> Path | None:
    """The system OpenBLAS library to preload, or None (not Linux, or not installed).

    Prefers `openblas-pthread/libblas.so.3` (package libopenblas0-pthread): a small shim with
    the standard BLAS/CBLAS symbols that pulls in libopenblas itself.
    """
    if sys.platform != "linux":
        return None
    for base in _lib_dirs():
        for name in ("openblas-pthread/libblas.so.3", "openblas-pthread/libopenblas.so.0",
                     "libopenblas.so.0"):
            candidate = base / name
            if candidate.is_file():
                return candidate
    return None


def _is_openblas(entry: str, lib: Path) -> bool:
    try:
        return Path(entry).resolve() == lib.resolve()
    except OSError:
        return False


def blas_env(enabled: bool, env: Mapping[str, str]) -> dict[str, str]:
    """A copy of `env` for a worker subprocess: with the system OpenBLAS first in LD_PRELOAD when
    `enabled`, or with it removed from LD_PRELOAD when not (so the parent's own preload does not
    leak into a worker configured without it). Other LD_PRELOAD entries are kept in order.
    Where no system OpenBLAS exists, `env` is returned unchanged (as a dict)."""
    out = dict(env)
    lib = find_openblas()
    if lib is None:
        return out
    # ld.so accepts both colons and spaces as separators.
    entries = [e for e in out.get("LD_PRELOAD", "").replace(" ", ":").split(":") if e]
    others = [e for e in entries if not _is_openblas(e, lib)]
    preload = [str(lib), *others] if enabled else others
    if preload:
        out["LD_PRELOAD"] = ":".join(preload)
    else:
        out.pop("LD_PRELOAD", None)
    return out


def _mapped_libraries() -> list[str]:
    try:
        text = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    # Lines are "address perms offset dev inode [path]"; anonymous mappings have no path.
    fields = (line.split(maxsplit=5) for line in text.splitlines())
    return sorted({f[5].strip() for f in fields if len(f) == 6 and ".so" in f[5]})


def describe_blas() -> str:
    """Which BLAS MLX's CPU matmuls use in this process, in one line for logs and /health."""
    if sys.platform == "darwin":
        return "Accelerate (macOS)"
    mapped = _mapped_libraries()
    # numpy's wheel maps its own scipy_openblas64_ (suffixed ILP64 symbols MLX never calls).
    system = [p for p in mapped if "openblas" in p and "scipy_openblas" not in p]
    if system:
        return f"OpenBLAS (preloaded: {', '.join(system)})"
    bundled = [p for p in mapped if "mlx_cpu.libs" in p and "libblas" in p]
    if bundled:
        return f"reference BLAS bundled with mlx ({bundled[0]}); slow, preload OpenBLAS"
    return "unknown BLAS (mlx not loaded yet)"


def openblas_loaded() -> bool:
    """True when the system OpenBLAS is mapped into this process (i.e. it was preloaded)."""
    lib = find_openblas()
    return lib is not None and any(_is_openblas(p, lib) for p in _mapped_libraries())


def reexec_with_blas(argv: Sequence[str] | None = None, *, enabled: bool = True) -> None:
    """Replace this process with itself preloading the system OpenBLAS, when that would change
    anything: Linux, `enabled`, OpenBLAS installed, not already loaded, and not already
    re-executed once (REEXEC_MARKER). Otherwise return and let the caller carry on.

    `argv` defaults to `sys.orig_argv` (interpreter flags and `-m` included). Call this first
    thing in a worker's main, before threads or sockets exist.
    """
    if not enabled or os.environ.get(REEXEC_MARKER) or openblas_loaded():
        return
    if find_openblas() is None:
        return
    env = blas_env(True, os.environ)
    env[REEXEC_MARKER] = "1"
    args = list(sys.orig_argv if argv is None else argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, args, env)


def matmul_gflops(n: int = 1024, repeats: int = 10) -> float:
    """Measured float32 n×n matmul throughput of MLX on this process's BLAS, in GFLOP/s."""
    import mlx.core as mx

    a = mx.random.normal((n, n), key=mx.random.key(0))
    b = mx.random.normal((n, n), key=mx.random.key(1))
    mx.eval(a @ b)  # warm up: first call pays allocation and thread start-up
    start = time.perf_counter()
    for _ in range(repeats):
        mx.eval(a @ b)
    elapsed = time.perf_counter() - start
    return 2 * n**3 * repeats / elapsed / 1e9


def main(argv: list[str] | None = None) -> int:
    """`python -m prefixd.backends.mlx.model.blas [N]`: the BLAS in use and its matmul GFLOP/s."""
    args = sys.argv[1:] if argv is None else argv
    n = int(args[0]) if args else 1024
    gflops = matmul_gflops(n)
    print(f"{describe_blas()}\n{n}x{n} float32 matmul: {gflops:.1f} GFLOP/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

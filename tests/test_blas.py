"""The OpenBLAS preload: worker environments, re-exec, and identical matmul results."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from prefixd.backends.mlx.model.blas import REEXEC_MARKER, blas_env, describe_blas, find_openblas

OPENBLAS = find_openblas()
needs_openblas = pytest.mark.skipif(OPENBLAS is None, reason="no system OpenBLAS (Linux only)")

# Prints the BLAS in use, then saves a deterministic matmul for comparison across processes.
MATMUL_SCRIPT = """
import sys
import mlx.core as mx
from prefixd.backends.mlx.model.blas import describe_blas
a = mx.random.normal((256, 256), key=mx.random.key(0))
b = mx.random.normal((256, 256), key=mx.random.key(1))
mx.save(sys.argv[1], a @ b)
print(describe_blas())
"""


def _run(code: str, env: dict[str, str], *args: str) -> str:
    done = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True,
                          text=True, timeout=120, check=True)
    return done.stdout


@needs_openblas
def test_blas_env_adds_first_keeps_others_and_removes_when_disabled() -> None:
    base = {"PATH": "/bin", "LD_PRELOAD": "/opt/libfoo.so /opt/libbar.so"}
    on = blas_env(True, base)
    assert on["LD_PRELOAD"] == f"{OPENBLAS}:/opt/libfoo.so:/opt/libbar.so"
    assert on["PATH"] == "/bin" and base["LD_PRELOAD"] == "/opt/libfoo.so /opt/libbar.so"
    assert blas_env(True, on)["LD_PRELOAD"] == on["LD_PRELOAD"]  # idempotent
    assert blas_env(False, on)["LD_PRELOAD"] == "/opt/libfoo.so:/opt/libbar.so"
    assert "LD_PRELOAD" not in blas_env(False, {"LD_PRELOAD": str(OPENBLAS)})
    assert blas_env(True, {})["LD_PRELOAD"] == str(OPENBLAS)


@needs_openblas
def test_preloaded_worker_uses_openblas_and_matches(tmp_path: Path) -> None:
    with_blas, without = tmp_path / "with.npy", tmp_path / "without.npy"
    on = _run(MATMUL_SCRIPT, blas_env(True, os.environ), str(with_blas))
    off = _run(MATMUL_SCRIPT, blas_env(False, os.environ), str(without))
    assert on.startswith("OpenBLAS") and str(OPENBLAS) in on
    assert off.startswith("reference BLAS bundled with mlx")
    np.testing.assert_allclose(np.load(with_blas), np.load(without), rtol=1e-4, atol=1e-4)


@needs_openblas
def test_reexec_preloads_once() -> None:
    code = (
        "import os\n"
        "from prefixd.backends.mlx.model.blas import describe_blas, reexec_with_blas\n"
        "print('start', flush=True)\n"
        "reexec_with_blas()\n"
        "reexec_with_blas()\n"
        "print(os.environ.get('" + REEXEC_MARKER + "'), describe_blas())\n"
    )
    out = _run(code, blas_env(False, os.environ)).splitlines()
    # One start before the exec, one after; the second call returns since OpenBLAS is loaded.
    assert out[:2] == ["start", "start"] and len(out) == 3
    assert out[2].startswith("1 OpenBLAS")
    disabled = "from prefixd.backends.mlx.model.blas import reexec_with_blas as r; r(enabled=False)"
    assert _run(disabled + "; print('ok')", blas_env(False, os.environ)) == "ok\n"


def test_describe_blas_names_something() -> None:
    import mlx.core as mx

    mx.eval(mx.ones((4, 4)) @ mx.ones((4, 4)))
    assert describe_blas().split()[0] in {"OpenBLAS", "reference", "Accelerate"}

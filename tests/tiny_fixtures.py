"""Session-scoped tiny model folders (built once per test session). Owned by the tiny-model factory.

Star-imported by tests/conftest.py, so only fixtures are exported.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

__all__ = ["tiny_model_dir"]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """A factory: `tiny_model_dir("qwen3_next")` is a folder `mlx_lm.load` opens offline.

    Each architecture is written once per session (seed 0) and shared by every test.
    """
    from prefixd.backends.mlx.model.tiny import save_tiny_model

    built: dict[str, Path] = {}

    def factory(arch: str) -> Path:
        if arch not in built:
            out = tmp_path_factory.mktemp(f"tiny-{arch}")
            built[arch] = save_tiny_model(arch, out)
        return built[arch]

    return factory

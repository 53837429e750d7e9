"""Found by the long fuzz run (docs/RELIABILITY.md): a `top_k` of the vocabulary's size or
more made mlx-lm's compiled sampler raise, which left MLX's global random state a trace
placeholder, so every later request on that worker failed with a 500."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import mlx.core as mx
import pytest
from aiohttp.test_utils import TestClient, TestServer
from mlx_lm.sample_utils import make_sampler

from prefixd.backends.mlx.scheduler.active import _reset_random_state
from prefixd.backends.mlx.scheduler.generator import Generator
from prefixd.backends.mlx.server.app import create_app
from prefixd.backends.mlx.settings import WorkerSettings
from tests.worker_fixtures import loaded


@pytest.fixture(scope="module")
def generator(tiny_model_dir: Callable[[str], Path]) -> Iterator[Generator]:
    gen = Generator(WorkerSettings(_env_file=None, max_tokens_default=3, use_system_blas=False))
    loaded(gen, str(tiny_model_dir("qwen3")))
    yield gen
    gen.close()


@pytest.fixture
async def client(generator: Generator) -> AsyncIterator[TestClient]:
    async with TestClient(TestServer(create_app(generator, "tiny", generator.settings))) as c:
        yield c


@pytest.mark.parametrize("top_k", [7537, 10**9, 1])
async def test_any_top_k_answers_and_the_next_request_still_works(client, top_k):
    hello = [{"role": "user", "content": "hi there"}]
    r = await client.post("/v1/chat/completions", json={"messages": hello, "top_k": top_k})
    assert r.status == 200, await r.text()
    r = await client.post("/v1/chat/completions", json={"messages": hello, "temperature": 0.7})
    assert r.status == 200, await r.text()


def test_a_sampler_failure_does_not_poison_later_sampling():
    logits = mx.random.normal((1, 50))
    with pytest.raises(ValueError):
        make_sampler(1.0, 1.0, 0.0, top_k=500)(logits)      # mlx-lm refuses top_k >= vocab
    _reset_random_state()
    assert 0 <= make_sampler(1.0, 1.0, 0.0)(logits).item() < 50

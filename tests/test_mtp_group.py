"""The model's own MTP head in a group (issue 51): two ranks on loopback, the model split
pipeline-parallel, each rank holding the head and drafting alike from the same hidden states
(mlx-lm gathers the last rank's to every rank), so the verify passes stay in lockstep; the
replies, alone and four at once, are those of one process without speculation."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from prefixd.backends.mlx.model.tiny import save_tiny_model
from tests.worker_process import get_json, post_json, running_worker

pytestmark = pytest.mark.slow
LOOPBACK_PAIR = json.dumps(["127.0.0.1", "127.0.0.1"])


def _post(url: str, words: str, times: int) -> dict[str, Any]:
    return post_json(url, "/v1/chat/completions", {
        "model": "tiny", "temperature": 0, "max_tokens": 48,
        "messages": [{"role": "user", "content": words * times}]}, "k")


def _cache(url: str) -> dict[str, Any]:
    return get_json(url, "/v1/cache", "k")


def test_a_pipeline_group_drafts_with_the_head_as_one_process_decodes(tmp_path: Path) -> None:
    """The group's ranks each load the head (none refused) and draft with it: alone and in a
    decode batch the replies equal one process's without speculation, and the head's drafts
    were verified (the group's totals by source)."""
    folder = save_tiny_model("qwen3_next", tmp_path / "m", words=3, mtp=True)
    asks = [(" the an some be on to", 4 + 3 * i) for i in range(4)]
    with running_worker(folder, "k", PREFIXD_SPECULATIVE="false") as one, \
            running_worker(folder, "k", PREFIXD_GROUP_HOSTS=LOOPBACK_PAIR) as group:
        spec = _cache(group)["speculative"]
        assert spec["mtp"] is True and spec["refused"] == {}
        want = [_post(one, *a)["choices"][0]["message"] for a in asks]
        alone = [_post(group, *a) for a in asks]
        with ThreadPoolExecutor(4) as pool:
            together = list(pool.map(lambda a: _post(group, *a)["choices"][0]["message"],
                                     asks))
        by_source = _cache(group)["speculative"]["by_source"]
    assert [r["choices"][0]["message"] for r in alone] == want
    assert together == want
    assert by_source["mtp"]["drafted"] > 0


def test_a_tensor_parallel_group_refuses_the_head_and_serves(tmp_path: Path) -> None:
    """Tensor-parallel ranks each hold a slice of the output projection, which the head
    shares: the head is refused (with why) on every rank, and the group serves without it."""
    folder = save_tiny_model("qwen3_5", tmp_path / "m", words=3, mtp=True)
    ask = (" the an some be on to", 5)
    with running_worker(folder, "k", PREFIXD_SPECULATIVE="false") as one, \
            running_worker(folder, "k", PREFIXD_GROUP_HOSTS=LOOPBACK_PAIR,
                           PREFIXD_PARALLEL="tensor") as group:
        spec = _cache(group)["speculative"]
        got, want = _post(group, *ask), _post(one, *ask)
    assert spec["mtp"] is False
    assert "tensor-parallel" in spec["refused"]["mtp"]["reason"]
    assert got["choices"][0]["message"] == want["choices"][0]["message"]

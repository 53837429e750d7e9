"""A reply ended by a stop string, and every miss named. The next turn repeats the reply's
text before the stop string. The reply used to be stored with the stop string's tokens fed:
full attention trimmed back, but recurrent layers and a wrapped sliding window cannot, so the
next turn restored its prompt only, and said nothing (its `miss` empty: a silent miss). Now the
worker keeps the recurrent state where text that may be a stop string begins (alone, or its row
copied out of a decode batch) and stores the reply up to the stop string; where it still cannot
(a sliding window), the next turn names the miss: `not_restorable`."""

from __future__ import annotations

import asyncio
import logging
import random
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from prefixd.backends.mlx.cache.store import CheckpointStore
from prefixd.backends.mlx.chat.prompt import Prompt
from prefixd.backends.mlx.chat.request import Sampling
from prefixd.backends.mlx.model.tiny import save_tiny_model
from prefixd.backends.mlx.scheduler.generator import Generator
from prefixd.backends.mlx.settings import WorkerSettings
from tests.worker_fixtures import collect, loaded

POOL = ["the", "an", "some", "be", "on", "to", "quick", "brown", "fox", "jumps", "over", "lazy",
        "dog"]


def test_shared_counts_the_tokens_an_entry_holds_restorable_or_not() -> None:
    store = CheckpointStore(1 << 20)
    entry = store.begin([1, 2, 3, 4, 5, 6], namespace="a")
    store.finish(entry, [1, 2, 3, 4, 5, 6], None, 0, False, lambda e: None)
    assert store.shared([1, 2, 3, 4, 9, 9]) == 0               # another partition's
    assert store.shared([1, 2, 3, 4, 9, 9], "a") == 4
    assert store.shared([1, 2, 3, 4, 5, 6, 7], "a") == 6       # at most len(prompt) - 1
    assert store.shared([1, 2, 3], "a") == 2


@pytest.fixture(scope="module", params=["qwen3", "qwen3_next", "falcon_h1", "gemma3_text"])
def worker(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> tuple[str, Generator]:
    path = save_tiny_model(request.param, tmp_path_factory.mktemp("words"), words=6)
    gen = loaded(Generator(WorkerSettings(_env_file=None, disk_cache_bytes=0,
                                          use_system_blas=False)), str(path))
    yield request.param, gen
    gen.close()


async def _probe(gen: Generator, encode: Callable[[str], list[int]], seed: int
                 ) -> tuple[list[int], str]:
    """A prompt of random words and its greedy reply (not stored where the tests look)."""
    rng = random.Random(seed)
    prompt = encode(" ".join(rng.choice(POOL) for _ in range(80)))
    text, _, _ = await collect(gen.submit(Prompt(prompt, []), Sampling(temperature=0), 40,
                                          namespace=f"probe{seed}"))
    return prompt, text


def _first_seen(text: str, start: int, n: int) -> int | None:
    """The first word index >= `start` whose `n` words are first seen in `text` there."""
    words = text.split()
    return next((i for i in range(start, len(words) - n + 1)
                 if text.find(" " + " ".join(words[i:i + n]))
                 == len(" " + " ".join(words[:i]))), None)


async def _stop_mid_reply(gen: Generator, encode: Callable[[str], list[int]],
                          caplog: pytest.LogCaptureFixture, company: int = 0
                          ) -> tuple[list[int], str, float]:
    """A prompt, its reply cut by a stop string (three words of its greedy reply, first
    seen at least 8 words in), and the mean decode batch it ran in (the worker's log line for
    it); with `company`, that many longer requests decode beside it, still decoding when it
    ends."""
    for seed in range(40):
        prompt, text = await _probe(gen, encode, seed)
        i = _first_seen(text, 8, 3)
        if i is not None:
            words = text.split()
            stop = " " + " ".join(words[i:i + 3])
            rng = random.Random(seed)
            others = [asyncio.ensure_future(collect(gen.submit(
                Prompt(encode(" ".join(rng.choice(POOL) for _ in range(30))), []),
                Sampling(temperature=0), 120, namespace="company"))) for _ in range(company)]
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="prefixd.worker"):
                cut, _, end = await collect(gen.submit(
                    Prompt(prompt, []), Sampling(temperature=0, stop=(stop,)), 40,
                    namespace=f"turns{company}"))
            outlasted = not any(other.done() for other in others)
            await asyncio.gather(*others)
            assert outlasted, "the company ended first"
            assert end.finish_reason == "stop" and cut == text[:text.find(stop)]
            line = next(r.getMessage() for r in caplog.records
                        if r.getMessage().startswith(f"worker: prompt {len(prompt)} tokens"))
            batch = re.search(r"decode batch ([0-9.]+)", line)
            assert batch is not None, line
            return prompt, cut, float(batch[1])
    raise AssertionError("no reply to cut")


@pytest.mark.parametrize("company", [0, 2], ids=["alone", "in-a-batch"])
async def test_the_next_turn_after_a_stop_string_restores_the_reply_or_names_the_miss(
        worker: tuple[str, Generator], company: int, caplog: pytest.LogCaptureFixture) -> None:
    """Alone or decoding in a batch with two others when its stop string comes (they decode
    longer: it ran in their batch, which it leaves only at its end)."""
    arch, gen = worker
    assert gen.loaded is not None
    encode = gen.loaded.tokenizer.encode
    prompt, reply, batch = await _stop_mid_reply(gen, encode, caplog, company)
    # the requests each of its decode passes fed, on average: about one alone, three beside two
    assert (batch > 2) is (company > 0), batch
    follow = [*prompt, *encode(reply), *encode(" and then more words here")]
    shared = len(prompt) + len(encode(reply))
    warm, _, end = await collect(gen.submit(Prompt(follow, []), Sampling(temperature=0), 8,
                                            namespace=f"turns{company}"))
    cold, _, _ = await collect(gen.submit(Prompt(follow, []), Sampling(temperature=0), 8,
                                          namespace="cold"))
    assert warm == cold
    assert end.prefixd is not None
    cache = end.prefixd["cache"]
    if arch != "gemma3_text":     # trimmed, or the recurrent state kept where the stop began
        assert end.cached_tokens == shared, company
        assert cache["miss"] is None
    else:                         # a wrapped window is not kept (it would be copied each step)
        assert end.cached_tokens < shared
        assert cache["known_tokens"] == shared
        assert cache["miss"] == "not_restorable"


def test_the_reason_is_documented() -> None:
    docs = (Path(__file__).resolve().parent.parent / "docs" / "CHECKPOINTS.md").read_text()
    assert "`not_restorable`" in docs


async def test_a_stop_string_found_in_text_held_since_an_earlier_token(
        worker: tuple[str, Generator]) -> None:
    """Text held back from one token on (it could begin one stop string) and a stop string
    found from the next token on (another): the reply is stored up to the second (the state
    kept at the first, the token between fed again), and the next turn restores all of it."""
    arch, gen = worker
    assert gen.loaded is not None
    encode = gen.loaded.tokenizer.encode
    for seed in range(40):
        prompt, text = await _probe(gen, encode, seed)
        found_at = _first_seen(text, 9, 2)     # the stop string's first word
        if found_at is not None:
            break
    assert found_at is not None
    at, words = found_at - 1, text.split()
    held, found = " " + " ".join(words[at:at + 2]) + " xyzzy", " " + " ".join(words[at + 1:at + 3])
    cut, _, end = await collect(gen.submit(Prompt(prompt, []),
                                           Sampling(temperature=0, stop=(held, found)), 40,
                                           namespace="held"))
    assert end.finish_reason == "stop" and cut == text[:text.find(found)]
    follow = [*prompt, *encode(cut), *encode(" and more")]
    warm, _, end = await collect(gen.submit(Prompt(follow, []), Sampling(temperature=0), 8,
                                            namespace="held"))
    cold, _, _ = await collect(gen.submit(Prompt(follow, []), Sampling(temperature=0), 8,
                                          namespace="held-cold"))
    assert warm == cold
    if arch != "gemma3_text":
        assert end.cached_tokens == len(prompt) + len(encode(cut))

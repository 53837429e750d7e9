"""The conversations of `bench/speculative.py`: agent-shaped requests whose replies copy from
their context (pure data: no HTTP, no model).

Each shape (see `bench/speculative.py`) is the agent's answer to the same request on another
file, then the request. `edit_tasks(n)`: n edit-shaped conversations on different methods of
four files (so their replies differ), the first of them the `edit` shape's; the requests of
`bench/speccompany.py`'s concurrent mode.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

SHAPES = ("rewrite", "edit", "patch", "paths", "json", "prose")
SYSTEM = "You are a coding agent. Follow the instructions exactly."

# Two files: the conversation shows the agent's answer on the first (a turn earlier in the
# conversation, as agents' histories do), the request asks the same of the second.
LIMITER = '''import time


class RateLimiter:
    """Allows `rate` calls per second, in bursts of at most `burst`."""

    def __init__(self, rate: float, burst: int = 10) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = float(burst)
        self.stamp = time.monotonic()

    def allow(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1:
            self.tokens -= 1
            return True
        return False
'''

PACING = '''from dataclasses import dataclass


@dataclass
class Pacing:
    """What the caller decides before each step: the next pass's size in tokens, and
    whether a pass under way pauses between two layers."""

    tokens: int
    share: int = 0
    pausable: bool = True

    def next_size(self, remaining: int) -> int:
        if remaining <= 0:
            return 0
        size = min(self.tokens, remaining)
        if self.share and size > self.share:
            size = self.share
        return max(1, size)

    def pauses(self, waiting: int) -> bool:
        return self.pausable and waiting > 0
'''


LRU = '''from collections import OrderedDict


class LRU:
    """A mapping that keeps its `size` most recently used keys."""

    def __init__(self, size: int = 128) -> None:
        self.size = size
        self.items: OrderedDict[str, bytes] = OrderedDict()

    def get(self, key: str) -> bytes | None:
        if key not in self.items:
            return None
        self.items.move_to_end(key)
        return self.items[key]

    def put(self, key: str, value: bytes) -> None:
        self.items[key] = value
        self.items.move_to_end(key)
        while len(self.items) > self.size:
            self.items.popitem(last=False)
'''

BACKOFF = '''import random


class Backoff:
    """Delays between retries: doubling from `base` up to `cap`, with jitter."""

    def __init__(self, base: float = 0.1, cap: float = 30.0) -> None:
        self.base = base
        self.cap = cap
        self.attempt = 0

    def delay(self) -> float:
        wait = min(self.cap, self.base * 2 ** self.attempt)
        self.attempt += 1
        return random.uniform(0, wait)

    def reset(self) -> None:
        self.attempt = 0
'''

Edit = tuple[str, str, str, str, str]  # path, source, method, old text, new text
# The first two: the `edit` shape's (its example, its request); the rest: more agents' edits.
EDITS: list[Edit] = [
    ("limiter.py", LIMITER, "allow", "return False", "return self.tokens >= 1"),
    ("pacing.py", PACING, "pauses", "waiting > 0", "waiting > 1"),
    ("lru.py", LRU, "get", "return None", "raise KeyError(key)"),
    ("backoff.py", BACKOFF, "delay", "random.uniform(0, wait)", "random.uniform(wait / 2, wait)"),
    ("pacing.py", PACING, "next_size", "return max(1, size)", "return max(2, size)"),
    ("lru.py", LRU, "put", "popitem(last=False)", "popitem(last=True)"),
    ("limiter.py", LIMITER, "__init__", "float(burst)", "0.0"),
    ("backoff.py", BACKOFF, "reset", "self.attempt = 0", "self.attempt = 1"),
]


def _method(src: str, name: str) -> str:
    lines = src.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.strip().startswith(f"def {name}("))
    end = next((i for i in range(start + 1, len(lines))
                if lines[i].strip().startswith("def ")), len(lines))
    return "\n".join(lines[start:end]).rstrip()


def _patch(path: str, old: str, new: str) -> str:
    body = "\n".join([*("-" + ln for ln in old.splitlines()),
                      *("+" + ln for ln in new.splitlines())])
    return f"*** Begin Patch\n*** Update File: {path}\n@@\n{body}\n*** End Patch"


def _record(job: str, name: str, status: str) -> dict[str, Any]:
    return {"id": job, "status": status, "owner": {"name": name,
            "email": f"{name.split()[0].lower()}@example.com"},
            "labels": ["cache", "prefix", "worker"],
            "limits": {"cpu": 2, "memory_gb": 24, "max_tokens": 4096},
            "created": "2026-11-28T09:31:33Z", "steps": [
                {"name": "restore", "ms": 12}, {"name": "prefill", "ms": 840},
                {"name": "decode", "ms": 5120}]}


def _turns(ask: Callable[[str, str], str], answer: Callable[[str], str],
           example: tuple[str, str], task: tuple[str, str]) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": ask(*example)},
            {"role": "assistant", "content": answer(example[1])},
            {"role": "user", "content": ask(*task)}]


def fence(path: str, src: str) -> str:
    return f"Here is the file {path}:\n```python\n{src}```\n"


def edit_ask(edit: Edit) -> str:
    path, src, name, old, new = edit
    return fence(path, src) + (f"Use the Edit tool to change `{old}` to `{new}` in "
                               f"`{name}`. Reply with the tool call's JSON arguments: "
                               "file_path, old_string (the whole method as it is), "
                               "new_string (the method after the change).")


def edit_answer(edit: Edit) -> str:
    path, src, name, old, new = edit
    method = _method(src, name)
    return json.dumps({"file_path": path, "old_string": method,
                       "new_string": method.replace(old, new)}, indent=1)


def edit_conversation(example: Edit, task: Edit) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": edit_ask(example)},
            {"role": "assistant", "content": edit_answer(example)},
            {"role": "user", "content": edit_ask(task)}]


def edit_tasks(n: int) -> list[list[dict[str, str]]]:
    """`n` edit-shaped conversations, each on another method (the first the `edit` shape's;
    the example: the agent's edit of `limiter.py`, or of `pacing.py` for a task on it)."""
    order = [EDITS[1], EDITS[0], *EDITS[2:]]
    if n > len(order):
        raise ValueError(f"at most {len(order)} different edit-shaped requests")
    return [edit_conversation(EDITS[1] if task[0] == "limiter.py" else EDITS[0], task)
            for task in order[:n]]


def conversations() -> dict[str, list[dict[str, str]]]:
    files = (("limiter.py", LIMITER), ("pacing.py", PACING))
    renames = {"limiter.py": ("RateLimiter", "Limiter"), "pacing.py": ("Pacing", "Pace")}
    edits = {e[0]: e[2:] for e in EDITS[:2]}

    def rewrite_ask(path: str, src: str) -> str:
        old, new = renames[path]
        return fence(path, src) + (f"Rewrite the whole file with the class `{old}` renamed to "
                                   f"`{new}`. Reply with the full file only.")

    def rewrite_answer(src: str) -> str:
        path = next(p for p, s in files if s == src)
        return "```python\n" + src.replace(*renames[path]) + "```"

    def patch_ask(path: str, src: str) -> str:
        name, old, new = edits[path]
        return fence(path, src) + (f"Write an apply_patch patch that changes `{old}` to "
                                   f"`{new}` in `{name}`, the whole method in - and + lines.")

    def patch_answer(src: str) -> str:
        path = next(p for p, s in files if s == src)
        name, old, new = edits[path]
        method = _method(src, name)
        return _patch(path, method, method.replace(old, new))

    listing = {"src": [f"src/prefixd/{d}/{m}.py" for d in ("engine", "cache")
                       for m in ("run", "batch", "store", "tap", "probe")],
               "tests": [f"tests/test_{m}_{k}.py" for m in ("engine", "cache", "worker")
                         for k in ("unit", "e2e", "load", "disk")]}

    def paths_ask(kind: str, listed: str) -> str:
        return (f"The tool `list_files` returned:\n{listed}\nCall the tool `read_file` on "
                "every path above, in order: one JSON object per line.")

    def paths_answer(listed: str) -> str:
        return "\n".join(json.dumps({"name": "read_file", "arguments": {"path": p}})
                         for p in listed.splitlines())

    records = {"a": _record("job-17", "Grace Hopper", "queued"),
               "b": _record("job-4711", "Ada Lovelace", "running")}

    def json_ask(key: str, text: str) -> str:
        return (f"The tool `get_job` returned:\n{text}\nReturn this JSON object exactly as "
                'it is, with "status" set to "done". Reply with the JSON only.')

    def json_answer(text: str) -> str:
        return json.dumps({**json.loads(text), "status": "done"}, indent=2)

    return {
        "rewrite": _turns(rewrite_ask, rewrite_answer, files[0], files[1]),
        "edit": edit_conversation(EDITS[0], EDITS[1]),
        "patch": _turns(patch_ask, patch_answer, files[0], files[1]),
        "paths": _turns(paths_ask, paths_answer, ("src", "\n".join(listing["src"])),
                        ("tests", "\n".join(listing["tests"]))),
        "json": _turns(json_ask, json_answer, ("a", json.dumps(records["a"], indent=2)),
                       ("b", json.dumps(records["b"], indent=2))),
        "prose": [{"role": "system", "content": SYSTEM},
                  {"role": "user", "content": "Write a short story, about 200 words, about a "
                   "lighthouse keeper who finds a message in a bottle."}],
    }


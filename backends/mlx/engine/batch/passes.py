"""What each forward pass of the worker carried: how many requests and how many tokens.

Owns: the totals since start by kind (a prefill pass: one request's slice; a decode pass: the
pending tokens of every request it fed, a newcomer's last prompt token among them (counted too:
`prompts_ended_in_decode`), `engine/batch/executor.py`, or one request's token and the draft it
verified, `engine/spec/speculate.py`), the largest decode batch, the last one, the tokens
drafted and accepted, the first prefill passes taken back one layer in to run again with
company (`run.Run`, `pacing.Regrouped`), the verify passes after which a batch squeezed its
rows' gaps out (`engine/batch/gapped.py`), and their Prometheus series (`metrics/worker.py`).
Generation thread only, like the Engine that owns it; read for `GET /v1/cache` (`batch`,
`speculative`) and the status page.
"""

from __future__ import annotations

from typing import Any

from prefixd.metrics import worker as metrics


class PassCounts:
    def __init__(self) -> None:
        self.passes = {"prefill": 0, "decode": 0}
        self.tokens = {"prefill": 0, "decode": 0}
        self.largest, self.last = 0, 0      # requests in a decode pass
        self.spec = {"verify_passes": 0, "drafted": 0, "accepted": 0,
                     "largest_verify_batch": 0, "recomputed_passes": 0, "squeezed_passes": 0}
        self.by_source: dict[str, dict[str, int]] = {}   # drafted, accepted per drafter
        self.rode = 0   # prompts whose last token a decode pass fed (no pass of their own)
        self.shared = self.shared_prompts = 0   # prefill passes of several prompts, and those
        self.ahead = {"used": 0, "undone": 0}   # decode passes launched ahead (`launch.py`)
        self.regrouped = 0   # first prefill passes taken back one layer in (`run.Run`)

    def prefill(self, tokens: int) -> None:
        self._count("prefill", 1, tokens)

    def decode(self, requests: int, tokens: int | None = None) -> None:
        """A decode pass of `requests` (`tokens` they kept: more than one each when it
        verified their drafts)."""
        self.largest, self.last = max(self.largest, requests), requests
        self._count("decode", requests, requests if tokens is None else tokens)

    def together(self, prompts: int, tokens: int) -> None:
        """A prefill pass of several prompts (`engine/batch/prefill.py`)."""
        self._count("prefill", prompts, tokens)
        self.shared += 1
        self.shared_prompts += prompts

    def launched(self, used: bool) -> None:
        """A decode pass launched ahead of its step was that step's pass (`used`), or was
        taken back (the rows or their tokens changed: its compute was lost)."""
        self.ahead["used" if used else "undone"] += 1

    def riders(self, prompts: int) -> None:
        """A decode pass fed the last token of `prompts` newcomers' prompts as rows."""
        self.rode += prompts

    def verify(self, requests: int, tokens: int, states: str = "none",
               squeezed: bool = False) -> None:
        """A decode pass of `requests` that verified drafts: `tokens` kept in all
        (`drafts` counts each request's); `states`: how it captured the recurrent and
        window states to go back ("kept" at each position, "recomputed" where needed:
        `engine/inpass/captured.py`, "none": every layer trims); `squeezed`: the batch's KV rows
        then had their gaps squeezed out (`engine/batch/gapped.py`: one gather of every row)."""
        self.decode(requests, tokens)
        self.spec["verify_passes"] += 1
        self.spec["recomputed_passes"] += states == "recomputed"
        self.spec["squeezed_passes"] += squeezed
        self.spec["largest_verify_batch"] = max(self.spec["largest_verify_batch"], requests)
        metrics.VERIFY_PASSES.labels(states).inc()

    def drafts(self, drafted: int, accepted: int, source: str = "lookup") -> None:
        """One request's draft in a pass (alone, or a row of a batch's), written by `source`
        (`Speculation.kind`)."""
        self.spec["drafted"] += drafted
        self.spec["accepted"] += accepted
        mine = self.by_source.setdefault(source, {"drafted": 0, "accepted": 0})
        mine["drafted"] += drafted
        mine["accepted"] += accepted
        metrics.DRAFT_TOKENS.labels("drafted", source).inc(drafted)
        metrics.DRAFT_TOKENS.labels("accepted", source).inc(accepted)

    def _count(self, kind: str, requests: int, tokens: int) -> None:
        self.passes[kind] += 1
        self.tokens[kind] += tokens
        metrics.PASS_REQUESTS.labels(kind).observe(requests)
        metrics.PASS_TOKENS.labels(kind).observe(tokens)

    def spec_info(self) -> dict[str, Any]:
        """The `speculative` part of GET /v1/cache (its counts)."""
        drafted = self.spec["drafted"]
        return {**self.spec, "acceptance": round(self.spec["accepted"] / drafted, 3)
                if drafted else None,
                "by_source": {k: dict(v) for k, v in self.by_source.items()}}

    def info(self) -> dict[str, Any]:
        """The `batch` part of GET /v1/cache."""
        decode = self.passes["decode"]
        return {"decode_passes": decode, "decode_tokens": self.tokens["decode"],
                "mean_decode_batch": round(self.tokens["decode"] / decode, 2) if decode else 0,
                "largest_decode_batch": self.largest, "last_decode_batch": self.last,
                "prefill_passes": self.passes["prefill"],
                "prefill_tokens": self.tokens["prefill"], "prompts_ended_in_decode": self.rode,
                "shared_prefill_passes": self.shared,
                "prompts_prefilled_together": self.shared_prompts,
                "passes_launched_ahead": self.ahead["used"],
                "passes_launched_ahead_undone": self.ahead["undone"],
                "prefill_passes_regrouped": self.regrouped}

"""Answering one generation job over HTTP: the whole response, or an SSE stream.

Owns: turning a `Job`'s events into OpenAI responses: text through `ChatOutput` (reasoning,
content, tool calls), log-probabilities sent with the chunk their text goes out in, usage and
the worker's `prefixd` breakdown (with the whole response, or with the usage chunk of a stream),
the `finish_reason`, and errors once a stream has started (SSE error events). Never raises to
aiohttp for a generation failure: a 500, or an SSE error event mid-stream.
"""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web

from prefixd.api.errors import ApiError, error_response
from prefixd.backends.mlx.chat.logprobs import TokenLogprob, chat_logprobs, completion_logprobs
from prefixd.backends.mlx.chat.oai import DONE, ChatOutput, Shapes, sse, usage
from prefixd.backends.mlx.chat.request import GenRequest
from prefixd.backends.mlx.scheduler.jobs import Failed, Finished, Job, Queued
from prefixd.backends.mlx.scheduler.output import Delta

log = logging.getLogger("prefixd.worker")


def _stopped() -> ApiError:
    return ApiError(503, "the worker stopped this generation (shutting down)",
                    type_="server_error")


def _with_breakdown(body: dict[str, Any], end: Finished) -> dict[str, Any]:
    """`body` with the worker's per-turn breakdown (`prefixd`: timings, checkpoints, cached
    and recomputed tokens, what it can restore now; see `engine/stats.py`) beside `usage`."""
    return {**body, "prefixd": end.prefixd} if end.prefixd is not None else body


def decode_header(end: Finished) -> dict[str, str]:
    """`X-Prefixd-Decode` on a whole response: the reply's tokens and, when it speculated,
    its verify passes and the tokens they drafted and accepted."""
    spec = (end.prefixd or {}).get("speculative")
    value = f"tokens={end.completion_tokens}"
    if isinstance(spec, dict):
        value += "; " + "; ".join(f"{k}={spec[k]}" for k in ("passes", "drafted", "accepted"))
    return {"X-Prefixd-Decode": value}


def _finish_reason(end: Finished, calls: list[dict[str, Any]]) -> str:
    """`tool_calls` for a reply that ended after its calls; a reply cut by `max_tokens` is
    `length` whatever calls it finished before the cut (never a finished call)."""
    return "tool_calls" if calls and end.finish_reason != "length" else end.finish_reason


class Reply:
    """One response being built: its request, shapes, text splitter and log-probabilities not
    sent yet."""

    def __init__(self, req: GenRequest, shapes: Shapes, job: Job, output: ChatOutput) -> None:
        self.req, self.shapes, self.job, self.output = req, shapes, job, output
        self._logprobs: list[TokenLogprob] = []
        self._offset = 0  # completions: where the next token starts in the text (text_offset)

    def _take_logprobs(self) -> dict[str, Any] | None:
        """The pending log-probabilities in this request's shape (None if not asked for)."""
        if self.req.logprobs is None:
            return None
        items, self._logprobs = self._logprobs, []
        if self.req.kind == "chat":
            return chat_logprobs(items)
        shaped = completion_logprobs(items, self._offset)
        self._offset += sum(len(t.token) for t in items)
        return shaped

    def _usage(self, end: Finished) -> dict[str, Any]:
        return usage(len(self.job.prompt.tokens), end.completion_tokens, end.cached_tokens)

    async def collect(self) -> web.Response:
        reasoning: list[str] = []
        content: list[str] = []
        async for event in self.job.events():
            if isinstance(event, Queued):
                continue
            if isinstance(event, Delta):
                r, c = self.output.feed(event.text)
                reasoning.append(r)
                content.append(c)
                self._logprobs.extend(event.logprobs)
            elif isinstance(event, Failed):
                return error_response(500, event.message)
            elif event.finish_reason == "cancelled":
                return _stopped().response()
            else:
                r, c, calls = self.output.finish(cut=event.finish_reason == "length")
                finish = _finish_reason(event, calls)
                return web.json_response(_with_breakdown(self.shapes.final(
                    "".join(content) + c, finish, self._usage(event), tool_calls=calls,
                    reasoning="".join(reasoning) + r, logprobs=self._take_logprobs(),
                    stop_reason=event.stop), event),
                    headers=decode_header(event))
        raise AssertionError("a job's events end with Finished or Failed")

    async def stream(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        try:
            if self.req.kind == "chat":
                await resp.write(sse(self.shapes.chunk(role=True)))
            async for event in self.job.events():
                if isinstance(event, Queued):   # as the proxy's queue says it (an SSE comment)
                    await resp.write(f": queued position={event.position}\n\n".encode())
                elif isinstance(event, Delta):
                    self._logprobs.extend(event.logprobs)
                    r, c = self.output.feed(event.text)
                    if r or c:
                        await resp.write(sse(self.shapes.chunk(
                            c, reasoning=r, logprobs=self._take_logprobs())))
                elif isinstance(event, Failed):
                    await resp.write(ApiError(500, event.message,
                                              type_="server_error").sse_event())
                    return resp
                elif event.finish_reason == "cancelled":  # shutdown; a gone client reads nothing
                    await resp.write(_stopped().sse_event())
                    return resp
                else:
                    await self._stream_end(resp, event)
            await resp.write(DONE)
            await resp.write_eof()
        except ConnectionResetError:
            log.info("worker: client went away mid-stream; generation stopped")
        return resp

    async def _stream_end(self, resp: web.StreamResponse, end: Finished) -> None:
        r, c, calls = self.output.finish(cut=end.finish_reason == "length")
        if r or c or self._logprobs:
            await resp.write(sse(self.shapes.chunk(c, reasoning=r,
                                                   logprobs=self._take_logprobs())))
        if calls:
            await resp.write(sse(self.shapes.chunk(tool_calls=calls)))
        await resp.write(sse(self.shapes.chunk(finish_reason=_finish_reason(end, calls),
                                               stop_reason=end.stop)))
        if self.req.include_usage:
            await resp.write(sse(_with_breakdown(self.shapes.usage_chunk(self._usage(end)), end)))

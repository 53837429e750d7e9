"""What prefixd asks of a llama-server over HTTP besides completions: `/props`, `/slots`, the
exact prompt tokens (`/apply-template` + `/tokenize`), and a slot's save, restore and erase
(`POST /slots/{id}?action=...`, with `--slot-save-path`).

Owns: one server's base URL and auth for those calls, each bounded in time. Nothing the
server answers is trusted: a malformed answer is None (or a `SlotActionError`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import aiohttp

from prefixd.api.values import integer

TOKENIZE_TIMEOUT_S = 10.0
NO_ENDPOINT = (404, 405, 501)   # a server without the endpoint (not a llama-server)
ACTION_TIMEOUT_S = 120.0     # a save waits for its slot to finish the request it runs


class NoEndpoint(Exception):
    """The server has no such endpoint: asking again will not help."""


class SlotActionError(Exception):
    """A save, restore or erase the server refused or could not do."""


@dataclass(frozen=True)
class SlotAction:
    slot: int
    tokens: int          # n_saved / n_restored
    bytes: int           # n_written / n_read
    ms: float


class LlamaAPI:
    def __init__(self, session: aiohttp.ClientSession, base: str, auth: dict[str, str]) -> None:
        self.session, self.base, self.auth = session, base.rstrip("/"), auth

    async def get_json(self, path: str, timeout: float = 5.0) -> Any:
        """GET `path`: its JSON, or None when it answers anything but 200."""
        async with self.session.get(self.base + path, headers=self.auth,
                                    timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            if r.status != 200:
                return None
            return await r.json(content_type=None)

    async def post_json(self, path: str, payload: dict, timeout: float) -> tuple[int, Any]:
        async with self.session.post(self.base + path, json=payload, headers=self.auth,
                                     timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            try:
                body = await r.json(content_type=None)
            except ValueError:
                body = None
            return r.status, body

    async def tokenize(self, body: dict, add_special: bool = True) -> list[int] | None:
        """The prompt's token ids as the server renders and tokenizes it (special tokens
        parsed; `add_special`: a BOS where the model adds one, as a completion's prompt
        gets), or None when it cannot tell now. `NoEndpoint` when the server has no
        `/apply-template` or `/tokenize`."""
        text = body.get("prompt") if "prompt" in body else None
        if text is None:
            answer = await self._post_ok("/apply-template", body)
            text = answer.get("prompt") if isinstance(answer, dict) else None
        if not isinstance(text, str):
            return None
        answer = await self._post_ok("/tokenize", {"content": text, "add_special": add_special,
                                                   "parse_special": True})
        tokens = answer.get("tokens") if isinstance(answer, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            return None
        return tokens

    async def _post_ok(self, path: str, payload: dict) -> Any:
        status, answer = await self.post_json(path, payload, TOKENIZE_TIMEOUT_S)
        if status in NO_ENDPOINT:
            raise NoEndpoint(path)
        return answer if status == 200 else None

    async def slot_action(self, slot: int, action: str, filename: str | None = None
                          ) -> SlotAction:
        """Save a slot into `filename` (under the server's --slot-save-path), restore one
        from it, or erase the slot."""
        payload = {"filename": filename} if filename is not None else {}
        try:
            status, answer = await self.post_json(f"/slots/{slot}?action={action}", payload,
                                                  ACTION_TIMEOUT_S)
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            raise SlotActionError(f"{action} slot {slot}: {e or type(e).__name__}") from e
        if status != 200 or not isinstance(answer, dict):
            error = answer.get("error") if isinstance(answer, dict) else None
            msg = error.get("message") if isinstance(error, dict) else None
            raise SlotActionError(f"{action} slot {slot}: HTTP {status} {msg or ''}".strip())
        key = {"save": ("n_saved", "n_written"), "restore": ("n_restored", "n_read")}
        n_tok, n_bytes = key.get(action, ("n_erased", ""))
        timings = answer.get("timings")
        ms = next((v for v in timings.values() if isinstance(v, int | float)), 0.0) \
            if isinstance(timings, dict) else 0.0
        return SlotAction(slot, integer(answer.get(n_tok)) or 0,
                          integer(answer.get(n_bytes)) or 0, float(ms))

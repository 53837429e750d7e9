"""Translation between the client APIs prefixd speaks besides chat completions and its one
internal form, an OpenAI `/v1/chat/completions` body: the Anthropic Messages API
(`/v1/messages`, Claude Code) and the OpenAI Responses API (`/v1/responses`, Codex CLI).

Owns: request validation and translation (client body -> chat body), answer translation
(chat.completion -> client object; chat chunks -> the client's SSE events) and the error
shapes of each API. Pure: no I/O, no aiohttp, no event loop; the pipeline wires it in.
Must not touch: the prefix tracker, routing, forwarding (they see only the chat body).
Contract: `base.Translator` / `base.StreamTranslator`; one class per API, wired to its route
in `proxy/apis.py` (`CLIENT_APIS`).
"""

from prefixd.proxy.translate.anthropic import AnthropicTranslator, count_tokens_request
from prefixd.proxy.translate.base import StreamTranslator, TranslateError, Translator
from prefixd.proxy.translate.responses import ResponsesTranslator

__all__ = ["AnthropicTranslator", "ResponsesTranslator", "StreamTranslator",
           "TranslateError", "Translator", "count_tokens_request"]

"""The client APIs prefixd answers: each one's route, the internal request form it becomes,
and its translator (`prefixd serve`'s pipeline and the gateway picker read the same table).
"""

from __future__ import annotations

from prefixd.api.schema import CHAT_PATH, COMPLETIONS_PATH
from prefixd.proxy.exchange import ClientApi
from prefixd.proxy.translate import AnthropicTranslator, ResponsesTranslator

CLIENT_APIS = (ClientApi("chat", CHAT_PATH, "chat"),
               ClientApi("completions", COMPLETIONS_PATH, "completion"),
               ClientApi("anthropic", "/v1/messages", "chat", AnthropicTranslator()),
               ClientApi("responses", "/v1/responses", "chat", ResponsesTranslator()))
API_BY_PATH = {api.path: api for api in CLIENT_APIS}

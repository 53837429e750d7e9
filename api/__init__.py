"""The OpenAI wire format, the lowest layer of prefixd: the error shape and the request
schema that both the proxy and the mlx worker use.

Owns: `errors` (the one builder of `{"error": {...}}` bodies, `ApiError`, the aiohttp error
middleware) and `schema` (pydantic models of /v1/chat/completions and /v1/completions bodies,
with the limits and the 400s both sides give). Imports nothing else of prefixd.
"""

"""Requests and replies as text: the typed request (`request.py`), the chat template and its
tokens with their message boundaries (`prompt.py`, `suffix.py`, `tooltext.py`), and the
OpenAI response shapes (`oai.py`, `logprobs.py`).

Owns: the meaning of a request before it is a job and of a reply after it is text. Pure: no
mlx, no threads. Imports only `cache.placement` (common prefixes).
"""

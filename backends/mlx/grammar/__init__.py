"""Structured output in the worker: the Lark grammar a request's constraint compiles to
(`lark.py`) and the llguidance matcher that masks tokens while decoding (`matcher.py`); whether
the prompt leaves a think block open is the prompt's (`chat.prompt.opens_think`, decided once).

Owns: nothing across requests but the tokenizer views it caches. Imports `chat` only.
"""

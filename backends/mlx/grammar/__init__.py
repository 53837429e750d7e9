"""Structured output in the worker: the Lark grammar a request's constraint compiles to
(`lark.py`), the llguidance matcher that masks tokens while decoding (`matcher.py`), and
whether a prompt leaves a think block open (`think.py`, decided once per job).

Owns: nothing across requests but the tokenizer views it caches. Imports `chat` only.
"""

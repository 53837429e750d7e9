"""States inside one forward pass: the in-pass tap (`tap.py`) records, at chosen positions of
a pass, the recurrent and window states the pass computes anyway, and `captured.py` turns that
record into states at any of those positions. Prefill checkpoints, verify passes and a batch's
rows going back all use it. Imports nothing of the engine.
"""

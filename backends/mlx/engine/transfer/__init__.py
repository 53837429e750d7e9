"""State moves between workers: a prefix's cache state out of one worker's Engine into a
self-describing bundle (`bundle.py`), and into another's after every check an untrusted input
must pass (`check.py`). Sits on the Engine (imports it); nothing in the engine imports it.
"""

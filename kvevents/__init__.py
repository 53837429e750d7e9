"""KV events in vLLM's format, both ways: what a model server holds, as the block-level event
stream fleet routers read (llm-d's precise prefix-cache scorer, Dynamo's KV router, SGLang's
gateway), and prefixd's own reading of such streams.

Owns: the wire format (`wire.py`: ZMQ multipart `[topic, sequence, msgpack batch]`, maps and
positional arrays), prefix ids over token ids (`prefix.py`), the publisher's diff of what is
restorable now against what it announced (`forest.py`) and its ZMQ sockets with the replay
buffer (`publisher.py`), and the subscriber's side: a token-level index of what one server
announced (`index.py`) and the subscription that feeds it, sequence gaps and replay included
(`subscriber.py`).

A leaf: imports no other prefixd package (the worker publishes through it, the proxy and the
gateway's picker subscribe through it). docs/KV_EVENTS.md is the reference.
"""

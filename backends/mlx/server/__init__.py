"""The worker's HTTP face: the aiohttp app (OpenAI and Anthropic-shaped endpoints, health,
cache, tokenize), answering a job as one response or an SSE stream, the state-move endpoints
and their signatures, and the socket-level 400s below the app.

Owns: nothing that outlives a request. It turns HTTP into `scheduler.Job`s and their events back
into HTTP; it never touches mlx. The top room: it may import every other room; none imports it.
"""

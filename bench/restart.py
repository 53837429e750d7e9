"""The disk tier of the worker's prompt cache (issue 15), side by side in one run.

    ./run bench restart                 # all four parts, ~6 min on 2 shared cores
    ./run bench restart --parts ad      # just (a) and (d)

(a) a 6-turn chat (workloads.chat) on a real worker process; before turn 4 the worker is
    restarted: SIGTERM (it writes its cache at shutdown), or SIGKILL once the write delay has
    passed (what the idle writer had written). Turn 4's TTFT and cached tokens against no restart
    and against a cold worker (no cache).
(b) 6 interleaved conversations (workloads.interleaved) with a RAM budget that holds about 2 of
    them: reuse with the disk tier against RAM only.
(c) a 50-turn agent-like session in-process (tool results of 200-2,000 tokens, turns 1 s apart;
    then 20 turns 3 s apart, so every turn goes idle and is written): bytes written to disk
    against what the disk holds at the end (the unique KV + the state records of the
    checkpoints kept) and against writing every checkpoint whole (its KV prefix + state).
(d) one long identical prompt: restore from disk (page cache dropped) vs from RAM vs a cold
    prefill, and vs reading the same files sequentially (page cache dropped); `--restores` disk
    restores per run (each by a new Engine), their median reported.
(e) conversations held per GiB of RAM budget: `--density-conversations` distinct 60-token
    prompts (8 tokens generated each) on `--density-model` (a built-in name, resolved under
    `--cache-dir` as the worker does, dequantized on the CPU as the worker does; or a folder);
    the store's bytes per conversation and MLX's active memory per conversation.

    ./run bench restart --parts e --density-model smollm2-135m-instruct

Writes bench/out/restart.json and bench/out/restart.md; results in docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from multiturn import (
    OUT,
    ensure_model,
    get_json,
    start_server,
    stop_server,
    stream_chat,
    wait_ready,
    warm_up,
)
from workloads import Reply, chat, interleaved


def _args(out: Path, env: dict[str, str]) -> argparse.Namespace:
    return argparse.Namespace(prefixd_env=env, kv_bits=None, out=out)


def _worker(model_dir: Path, out: Path, env: dict[str, str]) -> Any:
    s = start_server("prefixd", model_dir, _args(out, env))
    wait_ready(s)
    warm_up(s, 4)
    # A longer unrelated prompt too: the first passes of each chunk shape are slower, and a
    # restarted worker should not bill them to the turn being measured.
    _turn(s, [{"role": "user", "content": "warm " * 300}], 4)
    return s


def _turn(server: Any, messages: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    text, usage, ttft, _ = stream_chat(server.port, body)
    return {"text": text, "ttft": ttft, "prompt": usage["prompt_tokens"],
            "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
            "tier": ((usage.get("prefixd") or {}).get("cache") or {}).get("tier")}


def _wait_written(server: Any, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        disk = get_json(server.port, "/v1/cache").get("disk") or {}
        if disk.get("records") and not disk.get("pending_jobs") and \
                not disk.get("waiting_to_write"):
            return
        time.sleep(0.1)
    raise TimeoutError("the idle conversation was not written")


def part_a(model_dir: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    runs = [row for _ in range(args.repeats) for row in _part_a_once(model_dir, args)]
    rows = []
    for mode in dict.fromkeys(r["mode"] for r in runs):
        mine = [r for r in runs if r["mode"] == mode]
        rows.append({**mine[0], "ttft": round(statistics.median(r["ttft"] for r in mine), 4),
                     "ttft_runs": [round(r["ttft"], 3) for r in mine]})
    return rows


def _part_a_once(model_dir: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for mode in ("no restart", "SIGTERM", "SIGKILL after delay", "cold"):
        cache = Path(tempfile.mkdtemp(prefix="restart-a-"))
        env = {"PREFIXD_CACHE_DIR": str(cache), "PREFIXD_DISK_WRITE_DELAY": "1"}
        if mode == "cold":
            env |= {"PREFIXD_CACHE_BYTES": "0", "PREFIXD_DISK_CACHE_BYTES": "0"}
        server = _worker(model_dir, args.out, env)
        steps = chat(args.scale, random.Random("a"))
        step, _reply, turn = next(steps), None, 0
        try:
            while True:
                if turn == 3 and mode in ("SIGTERM", "SIGKILL after delay"):
                    if mode == "SIGKILL after delay":
                        _wait_written(server)
                        server.proc.send_signal(signal.SIGKILL)
                        server.proc.wait(timeout=30)
                    stop_server(server)
                    server = _worker(model_dir, args.out, env)
                got = _turn(server, step.body["messages"], args.max_tokens)
                if turn == 3:
                    rows.append({"mode": mode, **{k: got[k] for k in ("ttft", "prompt", "cached",
                                                                     "tier")}})
                    break
                turn += 1
                step = steps.send(Reply(got["text"]))
        finally:
            stop_server(server)
            shutil.rmtree(cache, ignore_errors=True)
        print(f"  (a) {mode:20} turn 4: {rows[-1]}", flush=True)
    return rows


def part_b(model_dir: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for label, disk in (("RAM only", "0"), ("RAM + disk", str(2**30))):
        cache = Path(tempfile.mkdtemp(prefix="restart-b-"))
        env = {"PREFIXD_CACHE_DIR": str(cache), "PREFIXD_DISK_CACHE_BYTES": disk,
               "PREFIXD_CACHE_BYTES": str(args.ram_budget)}
        server = _worker(model_dir, args.out, env)
        steps = interleaved(args.scale, random.Random("b"), conversations=6, rounds=3)
        got, reply, ttfts = [], None, []
        try:
            while True:
                try:
                    step = steps.send(reply) if reply is not None else next(steps)
                except StopIteration:
                    break
                r = _turn(server, step.body["messages"], args.max_tokens)
                got.append(r)
                ttfts.append(r["ttft"])
                reply = Reply(r["text"])
            info = get_json(server.port, "/v1/cache")
        finally:
            stop_server(server)
            shutil.rmtree(cache, ignore_errors=True)
        prompt = sum(r["prompt"] for r in got)
        cached = sum(r["cached"] for r in got)
        rows.append({"setup": label, "requests": len(got), "prompt_tokens": prompt,
                     "cached_tokens": cached, "reuse": round(cached / prompt, 3),
                     "disk_hits": sum(r["tier"] == "disk" for r in got),
                     "median_ttft": round(statistics.median(ttfts), 4),
                     "misses": info.get("misses")})
        print(f"  (b) {rows[-1]}", flush=True)
    return rows


def _engine(model: Any, root: Path, delay: float, **kw: Any) -> Any:
    from prefixd.backends.mlx.engine.engine import Engine, EngineConfig
    from prefixd.backends.mlx.engine.tierglue import DiskSpec

    return Engine(model, EngineConfig(**kw), DiskSpec(root, "bench", 8 * 2**30, delay, 256))


def _generate(engine: Any, prompt: list[int], bounds: tuple[int, ...] = ()) -> list[int]:
    """A request as the worker runs it (`Engine.steps`, whole chunks: a job alone); its
    stats in `LAST[engine]`."""
    import mlx.core as mx

    from prefixd.backends.mlx.engine.engine import Turn
    from prefixd.backends.mlx.engine.pacing import Pacing

    turn = Turn(Pacing(engine.config.prefill_chunk))
    steps = engine.steps(prompt, sampler=lambda lp: mx.argmax(lp, axis=-1), max_tokens=8,
                         boundaries=bounds, turn=turn)
    tokens = [step for step in steps if isinstance(step, int)]
    LAST[engine] = turn.stats
    return tokens


LAST: dict[Any, Any] = {}   # an engine's last request's stats


def part_c(model: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    from prefixd.backends.mlx.scheduler.writes import hand_over

    rows = []
    for turns, gap in ((args.agent_turns, 1.0), (20, 3.0)):
        root = Path(tempfile.mkdtemp(prefix="restart-c-"))
        engine = _engine(model, root, 2.0)
        rng = random.Random("c")
        prompt = [rng.randrange(1, 1000) for _ in range(800)]
        started = time.monotonic()
        for _t in range(turns):
            t0 = time.monotonic()
            bounds = (len(prompt),)
            prompt = prompt + _generate(engine, prompt, bounds)
            prompt += [rng.randrange(1, 1000) for _ in range(rng.randrange(200, 2000))]
            while time.monotonic() - t0 < gap:          # the agent runs its tool meanwhile
                hand_over(engine, engine.lockstep)   # what the worker does between jobs
                time.sleep(0.05)
        engine.persist()
        engine.close(120)
        disk = engine.cache_info()["disk"]
        on_disk = disk["bytes_used"]
        kv_per_token = _kv_per_token(engine)
        records = engine.tiers.disk.records.values()
        tails = sum(len(r.tail) for r in records) * kv_per_token
        state = sum(r.nbytes for r in records) - tails
        blocks = sum(b.nbytes for b in engine.tiers.disk.blocks.values())
        whole = sum(r.pos * kv_per_token for r in records) + state
        rows.append({"turns": turns, "gap_s": gap, "tokens": len(prompt),
                     "written_bytes": disk["written_bytes"], "on_disk_bytes": on_disk,
                     "unique_kv_bytes": blocks, "state_record_bytes": state,
                     "tail_kv_bytes": tails,
                     "written_over_kv_plus_state": round(disk["written_bytes"]
                                                         / (blocks + state), 3),
                     "every_checkpoint_whole_bytes": int(whole),
                     "records": disk["records"], "blocks": disk["blocks"],
                     "seconds": round(time.monotonic() - started, 1)})
        shutil.rmtree(root, ignore_errors=True)
        print(f"  (c) {rows[-1]}", flush=True)
    return rows


def _kv_per_token(engine: Any) -> int:
    blocks = engine.tiers.disk.blocks
    return int(statistics.median(b.nbytes for b in blocks.values()) // 256) if blocks else 0


def _drop_page_cache(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def part_d(model: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    root = Path(tempfile.mkdtemp(prefix="restart-d-"))
    rng = random.Random("d")
    prompt = [rng.randrange(1, 1000) for _ in range(args.long_prompt)]
    rows = []
    for _ in range(3):
        cold = _engine(model, root / "cold", 0.0, cache_bytes=0)
        _generate(cold, prompt)
        cold_s = LAST[cold].prefill_s
        cold.close(5)
        writer = _engine(model, root, 0.0)
        _generate(writer, prompt)
        _generate(writer, prompt)                    # RAM restore of the same prompt
        ram_s = LAST[writer].lookup_s + LAST[writer].restore_s
        writer.persist()
        writer.close(60)
        restores = [_disk_restore(model, root, prompt) for _ in range(args.restores)]
        shutil.rmtree(root, ignore_errors=True)
        disk_s = statistics.median(r[0] for r in restores)
        read_s = statistics.median(r[1] for r in restores)
        rows.append({"prompt_tokens": len(prompt), "cached": restores[0][3],
                     "tier": restores[0][4], "cold_prefill_s": round(cold_s, 4),
                     "ram_restore_s": round(ram_s, 4), "disk_restore_s": round(disk_s, 4),
                     "disk_restore_runs": [round(r[0], 4) for r in restores],
                     "sequential_read_s": round(read_s, 4), "bytes": restores[0][2],
                     "disk_over_read": round(disk_s / read_s, 2)})
        print(f"  (d) {rows[-1]}", flush=True)
    return rows


def _disk_restore(model: Any, root: Path, prompt: list[int]) -> tuple[float, float, int, int,
                                                                      str | None]:
    """(disk restore s, sequential read s of the same files, their bytes, cached tokens,
    tier) by a new Engine over `root`, the page cache dropped before each read."""
    from prefixd.backends.mlx.disk.chain import as_tokens

    reader = _engine(model, root, 0.0)
    rec, _pos = reader.tiers.disk.lookup(as_tokens(prompt))
    files = reader.tiers.disk.pin(rec)            # the files this restore reads
    reader.tiers.disk.unpin(rec)
    _drop_page_cache(files)
    t0 = time.perf_counter()
    nbytes = sum(len(p.read_bytes()) for p in files)
    read_s = time.perf_counter() - t0
    _drop_page_cache(files)
    _generate(reader, prompt)
    st = LAST[reader]
    reader.close(5)
    return st.disk_load_s, read_s, nbytes, st.cached_tokens, st.tier


def part_e(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Conversations per GiB of RAM budget: what the store holds per short conversation, as
    it budgets it and as MLX allocates it."""
    import gc

    import mlx.core as mx

    from prefixd.backends.mlx.engine.engine import Engine, EngineConfig
    from prefixd.backends.mlx.engine.loading import wants_dequantize
    from prefixd.backends.mlx.model.provision import load_model

    spec = args.density_model or str(ensure_model(args.model, args.models_dir))
    model, _ = load_model(spec, args.cache_dir, dequantize=wants_dequantize("auto", spec))
    engine = Engine(model, EngineConfig(cache_bytes=64 * 2**30))
    gc.collect()
    base = mx.get_active_memory()
    rng = random.Random("e")
    for _ in range(args.density_conversations):
        _generate(engine, [rng.randrange(100, 40000) for _ in range(60)])
    gc.collect()
    mx.clear_cache()
    store = engine.store
    per = store.bytes_used / len(store.entries)
    row = {"model": Path(spec).name, "conversations": len(store.entries),
           "tokens_each": len(store.entries[0].tokens), "bytes_each": int(per),
           "active_bytes_each": int((mx.get_active_memory() - base) / len(store.entries)),
           "per_gib": round(2**30 / per, 1)}
    print(f"  (e) {row}", flush=True)
    return [row]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", default="abcd")
    p.add_argument("--model", default="qwen3_5", help="tiny architecture (bench/out/models)")
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--ram-budget", type=int, default=2**20,
                   help="(b) PREFIXD_CACHE_BYTES: about two of the conversations")
    p.add_argument("--agent-turns", type=int, default=50)
    p.add_argument("--repeats", type=int, default=3, help="(a) runs per mode (median)")
    p.add_argument("--long-prompt", type=int, default=7400)
    p.add_argument("--restores", type=int, default=5, help="(d) disk restores per run")
    p.add_argument("--density-model", default=None,
                   help="(e) a built-in model name or a folder (default: the tiny --model)")
    p.add_argument("--density-conversations", type=int, default=30)
    p.add_argument("--cache-dir", type=Path,
                   default=Path(os.environ.get("PREFIXD_CACHE_DIR", "~/.cache/prefixd"))
                   .expanduser(), help="(e) where built-in models are (as the worker's)")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--models-dir", type=Path, default=OUT / "models")
    args = p.parse_args(argv)
    model_dir = ensure_model(args.model, args.models_dir)
    results: dict[str, Any] = {"model": args.model}
    if "a" in args.parts:
        results["a"] = part_a(model_dir, args)
    if "b" in args.parts:
        results["b"] = part_b(model_dir, args)
    if "c" in args.parts or "d" in args.parts:
        from prefixd.backends.mlx.model.provision import load_model

        model, _ = load_model(str(model_dir), args.out)
        if "c" in args.parts:
            results["c"] = part_c(model, args)
        if "d" in args.parts:
            results["d"] = part_d(model, args)
    if "e" in args.parts:
        results["e"] = part_e(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "restart.json").write_text(json.dumps(results, indent=1))
    lines = [f"# bench/restart.py ({args.model})"]
    for part, rows in results.items():
        if part == "model" or not rows:
            continue
        keys = list(rows[0])
        lines += ["", f"## ({part})", "", "| " + " | ".join(keys) + " |",
                  "|" + "---|" * len(keys)]
        lines += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows]
    (args.out / "restart.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Managed llama-servers without a server (issue 50): the slot decision table, slot files
(llama.cpp's `ggsq` state files, written here byte for byte as llama-server writes them), the
kind's configuration and its start-up errors."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from prefixd.backends.config import BackendConfig
from prefixd.backends.llama import command as cmd
from prefixd.backends.llama.placement import Placement, SlotHeld, place
from prefixd.backends.llama.slotfiles import SlotFiles, common, pack, read_tokens


def S(held: int = 0, size: int = 0, saved: bool = True, busy: bool = False,
      used: float = 0.0) -> SlotHeld:
    return SlotHeld(held, size, saved, busy, used)


@pytest.mark.parametrize(("slots", "file_tokens", "want"), [
    # its own slot holds all of it (the next turn): there, nothing to save
    ([S(0, 300, False), S(500, 500, False)], 0, Placement(1, "holds_prefix", False, False, 500)),
    # a slot shares the system prompt but holds another conversation, unsaved: that one is
    # saved and restored into the empty slot (a copy), so it keeps its own slot
    ([S(200, 900, False, used=1.0), S(0, 0)], 0,
     Placement(1, "copy", True, False, 200, source=0)),
    # ... no free slot: the other conversation is saved, then displaced
    ([S(200, 900, False, used=1.0), S(0, 700, False, used=2.0)], 0,
     Placement(0, "holds_prefix", False, True, 200)),
    # ... but a chat template's opening few tokens evict nobody while a slot is empty
    ([S(5, 172, False), S(0, 0)], 0, Placement(1, "fresh", False, False, 0)),
    # ... already saved (in a file): displaced without a save when no slot is free
    ([S(200, 900, True), S(0, 700, False)], 0, Placement(0, "holds_prefix", False, False, 200)),
    # a slot file holds more than any slot: restored into the slot whose loss costs least
    # (an empty one), not into the one that shares a little
    ([S(100, 800, False), S(0, 0, True, used=5.0)], 700,
     Placement(1, "restore", True, False, 700)),
    # ... every slot holds unsaved prompts: the least recently used is saved, then restored
    ([S(0, 800, False, used=2.0), S(0, 600, False, used=1.0)], 700,
     Placement(1, "restore", True, True, 700)),
    # a file only a little better than the slot: the slot (a restore is not worth it)
    ([S(600, 600, False), S(0, 0)], 620, Placement(0, "holds_prefix", False, False, 600)),
    # nothing shared anywhere: the cheapest slot (saved beats unsaved, then least recently used)
    ([S(0, 900, False, used=0.0), S(0, 400, True, used=9.0), S(0, 400, True, used=3.0)], 0,
     Placement(2, "fresh", False, False, 0)),
    # busy slots are never chosen, however much they hold
    ([S(900, 900, False, busy=True), S(0, 0)], 0, Placement(1, "fresh", False, False, 0)),
    ([S(busy=True), S(busy=True)], 500, None),
])
def test_slot_decision_table(slots, file_tokens, want):
    assert place(slots, file_tokens) == want


# --- slot files ----------------------------------------------------------------------------

def write_slot_file(path: Path, tokens: list[int], state: bytes = b"\x07" * 4096,
                    packed: bool = True) -> None:
    """A slot file as llama-server writes it: `ggsq`, version, the packed server tokens
    (marker -1, their version, the token list, no media) and the sequence state."""
    body = [-1, 1, len(tokens), *tokens, 0] if packed else tokens
    path.write_bytes(struct.pack("<III", 0x67677371, 3, len(body))
                     + struct.pack(f"<{len(body)}i", *body) + state)


def test_read_tokens_both_layouts_and_refuses_what_is_not_one(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    write_slot_file(a, [5, 6, 7])
    write_slot_file(b, [5, 6, 7], packed=False)
    assert read_tokens(a) == read_tokens(b) == pack([5, 6, 7])
    (tmp_path / "c").write_bytes(b"GGUF" + b"\0" * 40)
    (tmp_path / "d").write_bytes(a.read_bytes()[:20])            # cut short
    assert read_tokens(tmp_path / "c") is None and read_tokens(tmp_path / "d") is None
    assert read_tokens(tmp_path / "none") is None


@given(st.lists(st.integers(0, 3), max_size=40), st.lists(st.integers(0, 3), max_size=40))
def test_common_is_the_longest_shared_start(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    assert common(pack(a), pack(b)) == n


def saved(files: SlotFiles, tokens: list[int], state: bytes = b"\x07" * 4096) -> str:
    name = files.new_name()
    write_slot_file(files.dir / name, tokens, state)
    assert files.added(name, len(tokens)) is not None
    return name


def test_files_index_supersede_and_keep_the_budget(tmp_path):
    files = SlotFiles(tmp_path, "fp", budget=3 * 4300)
    files.load()
    a1 = saved(files, [1, 2, 3])
    a2 = saved(files, [1, 2, 3, 4, 5])          # the same conversation, later: supersedes a1
    assert a1 not in files.files and not (files.dir / a1).exists()
    b = saved(files, [9, 9])
    assert files.best(pack([1, 2, 3, 4, 5, 6])) == (files.files[a2], 5)
    assert files.best(pack([9, 9, 1]))[0] is files.files[b]
    assert files.best(pack([7])) == (None, 0)
    files.used(files.files[a2])                  # a2 used last: b goes first
    c = saved(files, [4, 4])
    d = saved(files, [3, 3])
    assert set(files.files) == {a2, c, d} and files.counts["evicted"] == 1
    assert files.size <= files.budget
    saved_big = files.new_name()                 # larger than the whole budget: not kept
    write_slot_file(files.dir / saved_big, [8], b"\0" * 20000)
    assert files.added(saved_big, 1) is None
    assert not (files.dir / saved_big).exists()
    # a save whose header does not say what the server reported is not indexed
    bad = files.new_name()
    write_slot_file(files.dir / bad, [1, 1])
    assert files.added(bad, 3) is None and files.counts["save_unreadable"] == 1
    # a second process reads the same index back
    again = SlotFiles(tmp_path, "fp", budget=files.budget)
    again.load()
    assert set(again.files) == set(files.files)
    assert again.files[a2].tokens == pack([1, 2, 3, 4, 5])


def test_damaged_missing_and_foreign_files_are_counted_misses(tmp_path):
    files = SlotFiles(tmp_path, "fp", budget=1 << 30)
    files.load()
    a = saved(files, [1, 2, 3])
    b = saved(files, [4, 5, 6])
    c = saved(files, [7, 8])
    assert files.check(files.files[a]) == "hit"
    raw = bytearray((files.dir / a).read_bytes())   # one byte of KV flipped, same size
    raw[-10] ^= 0xFF
    (files.dir / a).write_bytes(bytes(raw))
    entry = files.files[a]
    assert files.check(entry) == "damaged" and a not in files.files
    assert not (files.dir / a).exists()
    (files.dir / b).unlink()
    assert files.check(files.files[b]) == "missing"
    # after a restart: a file whose header no longer says what the index does, a file the
    # index never named, an index entry without its file
    write_slot_file(files.dir / c, [7, 9, 9])
    write_slot_file(files.dir / "stranger.bin", [1, 2, 3])
    index = json.loads((files.dir / "index.json").read_text())
    index["files"].append({**index["files"][0], "name": "gone.bin"})
    (files.dir / "index.json").write_text(json.dumps(index))
    again = SlotFiles(tmp_path, "fp", budget=1 << 30)
    again.load()
    assert again.files == {}
    assert again.counts == {"damaged": 1, "missing": 1, "foreign": 2}
    assert sorted(os.listdir(again.dir)) == ["index.json"]
    (again.dir / "index.json").write_text("{not json")      # a torn index: nothing indexed
    third = SlotFiles(tmp_path, "fp", budget=1 << 30)
    third.load()
    assert third.files == {}


def test_files_of_another_model_or_flags_live_apart(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 100)
    base = BackendConfig(name="l", kind="llama", model=str(gguf))
    flags = base.model_copy(update={"llama_args": ["-ctk", "q8_0"]})
    one = cmd.fingerprint(gguf, base)
    assert one == cmd.fingerprint(gguf, base) != cmd.fingerprint(gguf, flags)
    gguf.write_bytes(b"GGUF" + b"\1" * 101)          # the model file changed in place
    assert cmd.fingerprint(gguf, base) != one


# --- the kind's configuration ---------------------------------------------------------------

def test_llama_config_needs_a_model_and_sends_a_request_per_slot(tmp_path):
    with pytest.raises(ValidationError, match="kind 'llama' needs 'model'"):
        BackendConfig(name="l", kind="llama")
    c = BackendConfig(name="l", kind="llama", model="/m/SmolLM2-135M.Q4_1.gguf", slots=3)
    assert c.models == ["SmolLM2-135M.Q4_1"] and c.concurrency == 3
    assert BackendConfig(name="l", kind="llama", model="x").concurrency == 4


def test_the_command_line_carries_prefixd_flags_then_the_users(tmp_path):
    fake = tmp_path / "llama-server"                 # a build that knows some flags only
    fake.write_text("#!/bin/sh\necho '  --metrics  -sps, --slot-prompt-similarity N'\n"
                    "echo '  --slot-save-path PATH   --cache-ram N'\n")
    fake.chmod(0o755)
    c = BackendConfig(name="l", kind="llama", model="m.gguf", models=["m"], slots=2,
                      context_window=1000, llama_args=["-t", "3", "-sps", "0.5"])
    argv = cmd.command(fake, Path("m.gguf"), c, 4242, tmp_path / "s", 512)
    assert argv[:10] == [str(fake), "-m", "m.gguf", "--host", "127.0.0.1", "--port", "4242",
                         "-np", "2", "-c"] and argv[10] == "2000"
    assert "--no-kv-unified" not in argv             # this build does not know it
    assert argv[-4:] == ["-t", "3", "-sps", "0.5"]   # the user's last: theirs win
    for flag, value in (("--slot-save-path", str(tmp_path / "s")), ("--cache-ram", "512"),
                        ("-sps", "0")):
        assert argv[argv.index(flag) + 1] == value
    env = cmd.env("tok", {"PATH": "/bin", "PREFIXD_X": "1", "LLAMA_ARG_N_PARALLEL": "9",
                          "LLAMA_API_KEY": "theirs"})
    assert env == {"PATH": "/bin", "LLAMA_API_KEY": "tok"}


def test_a_missing_binary_is_a_start_up_error_that_says_how_to_get_one(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(cmd.LlamaSetupError, match=r"build_llama_server\.sh"):
        cmd.find_binary(None, tmp_path)
    with pytest.raises(cmd.LlamaSetupError, match="not an executable"):
        cmd.find_binary(str(tmp_path / "nope"), tmp_path)
    built = cmd.build_path(tmp_path)
    built.parent.mkdir(parents=True)
    built.write_text("#!/bin/sh\n")
    built.chmod(0o755)
    assert cmd.find_binary(None, tmp_path) == built
    with pytest.raises(cmd.LlamaSetupError, match="not a built-in model"):
        cmd.resolve_gguf(str(tmp_path / "nothing.gguf"), tmp_path)


def gguf_file(path: Path, arch: str, first: list[tuple[str, int, bytes]],
              after: list[tuple[str, int, bytes]] = ()) -> None:  # type: ignore[assignment]
    """A GGUF header: the `first` keys (raw typed values), general.architecture, `after`."""
    def s(b: bytes) -> bytes:
        return struct.pack("<Q", len(b)) + b

    def kvs(items: list[tuple[str, int, bytes]]) -> bytes:
        return b"".join(s(k.encode()) + struct.pack("<I", t) + v for k, t, v in items)
    body = (kvs(first) + s(b"general.architecture") + struct.pack("<I", 8) + s(arch.encode())
            + kvs(list(after)))
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(first) + 1 + len(after)) + body
                     + b"\0" * 1000)


def test_hybrid_and_windowed_models_credit_only_whole_slots_and_files(tmp_path):
    """A recurrent state or a sliding window resumes only at its end (slot files keep no
    context checkpoints): a prompt that leaves a file or a slot midway is credited nothing
    of it, so the keeper never counts on a state the server would recompute."""
    from prefixd.backends.llama.keeper import SlotKeeper

    arr = struct.pack("<IQ", 8, 2) + b"".join(struct.pack("<Q", 1) + c for c in (b"a", b"b"))
    gguf_file(tmp_path / "q.gguf", "qwen35", [("general.name", 8, struct.pack("<Q", 2) + b"q3"),
                                              ("tok.list", 9, arr),
                                              ("n", 4, struct.pack("<I", 7))])
    gguf_file(tmp_path / "l.gguf", "llama", [])
    assert cmd.gguf_architecture(tmp_path / "q.gguf") in cmd.WHOLE_ONLY
    assert cmd.gguf_architecture(tmp_path / "l.gguf") not in cmd.WHOLE_ONLY
    (tmp_path / "x.gguf").write_bytes(b"GGUF\0\0")
    assert cmd.gguf_architecture(tmp_path / "x.gguf") is None
    files = SlotFiles(tmp_path, "fp", budget=1 << 30)
    files.load()
    long = saved(files, [1, 2, 3, 4, 5, 6])        # the prompt leaves it after 3 tokens
    short = saved(files, [1, 2])                    # ... and extends all of this one
    prompt = pack([1, 2, 3, 9, 9])
    assert files.best(prompt) == (files.files[long], 3)
    assert files.best(prompt, whole=True) == (files.files[short], 2)
    plain, hybrid = SlotKeeper("p", None, 1, None), SlotKeeper("h", None, 1, None, True)  # type: ignore[arg-type]
    assert plain._held(pack([1, 2, 3, 4]), prompt) == 3
    assert hybrid._held(pack([1, 2, 3, 4]), prompt) == 0
    assert hybrid._held(pack([1, 2, 3]), prompt) == 3


def test_the_memory_estimate_counts_the_kv_of_every_slot(tmp_path):
    """Before a llama-server first loads, the model pool counts its GGUF, its slots' KV
    cache (from the model's shape in the GGUF header) and its RAM cache."""
    from prefixd.backends.budget import PROCESS_OVERHEAD
    from prefixd.backends.llama.managed import LlamaBackend
    from prefixd.backends.mlx.settings import WorkerSettings
    from prefixd.proxy.pool import ModelPool

    u32 = lambda n: struct.pack("<I", n)  # noqa: E731
    gguf = tmp_path / "m.gguf"                      # SmolLM2-135M's shape
    gguf_file(gguf, "llama", [], [("llama.block_count", 4, u32(30)),
                                  ("llama.embedding_length", 4, u32(576)),
                                  ("llama.attention.head_count", 4, u32(9)),
                                  ("llama.attention.head_count_kv", 4, u32(3))])
    facts = cmd.gguf_facts(gguf)
    assert facts["llama.block_count"] == 30
    assert cmd.kv_bytes_per_token(facts) == 2 * 30 * 3 * (64 + 64)   # f16 K and V
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    config = BackendConfig(name="l", kind="llama", model=str(gguf), slots=3,
                           context_window=1000, cache_bytes=5 << 20)
    backend = LlamaBackend(config, WorkerSettings(_env_file=None, cache_dir=tmp_path,
                                                  disk_cache_bytes=0), str(fake))
    pool = ModelPool([backend], {"l": None}, budget=1 << 40, cache_bytes=None,  # type: ignore[dict-item]
                     share=False)
    assert pool.footprints["l"] == (gguf.stat().st_size + 3 * 1000 * 23040 + (5 << 20)
                                    + PROCESS_OVERHEAD)

"""Restart persistence of the disk KV tier (--kv-offload-dir).

Every block that becomes full is written through to disk in the background,
so what an engine still caches when it stops is on disk, and the next engine
on the same folder serves the same prompt from it. A process killed at any
moment leaves only whole files (or temporary ones, deleted at start), and a
file damaged by hand is rejected on read, never loaded.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from server_process import ServerProcess

from pagedkv import LLM, SamplingParams
from pagedkv.kv.hashing import hash_block_tokens
from pagedkv.kvstore import disk_tier
from pagedkv.kvstore.block_file import SUFFIX, TMP_SUFFIX
from pagedkv.kvstore.disk_tier import DiskTier

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCK = 4
PROMPT = (
    "Paged attention keeps the KV cache in blocks. Hello world! Serving a model means "
    "holding each request's cache while it grows a token at a time. "
) * 3
OTHERS = [
    f"{i} The quick brown fox jumps over the lazy dog. Memory is cut into fixed-size blocks."
    for i in range(6)
]
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
SERVE = (
    "--block-size",
    str(BLOCK),
    "--num-gpu-blocks-override",
    "256",
    "--served-model-name",
    "tiny",
)


def make_llm(model_dir, **options) -> LLM:
    return LLM(model_dir, dtype="float32", block_size=BLOCK, num_gpu_blocks_override=256, **options)


def run(llm: LLM, prompts: list[str]) -> list[tuple[list[int], int]]:
    """(output token ids, cached prompt tokens) per prompt."""
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.num_cached_tokens) for o in outs]


def block_files(root: Path) -> list[Path]:
    return sorted(root.rglob(f"*{SUFFIX}"))


def full_hit(prompt: str | int, llm: LLM | None = None) -> int:
    """Tokens a whole prefix hit covers: every full block but the one of the last prompt token."""
    n = prompt if isinstance(prompt, int) else len(llm.get_tokenizer().encode(prompt))
    return (n - 1) // BLOCK * BLOCK


@pytest.fixture(scope="module")
def cold(tiny_model_dir) -> dict[str, tuple[list[int], str]]:
    """What an engine with no tier answers: (token ids, text) per prompt."""
    outs = make_llm(tiny_model_dir).generate([PROMPT, *OTHERS], GREEDY, use_tqdm=False)
    return {p: (o.outputs[0].token_ids, o.outputs[0].text) for p, o in zip([PROMPT, *OTHERS], outs)}


# ---- in process ------------------------------------------------------------------------------


def test_what_is_cached_at_a_graceful_close_is_served_from_disk_after_restart(
    tiny_model_dir, tmp_path, cold
):
    first = make_llm(tiny_model_dir, kv_offload_dir=str(tmp_path))
    n_prompt = len(first.get_tokenizer().encode(PROMPT))
    assert run(first, [PROMPT]) == [(cold[PROMPT][0], 0)]
    assert run(first, [PROMPT])[0][1] == full_hit(n_prompt)  # a device hit: nothing new to write
    first.engine.close()
    st = first.engine.offload.stats()
    computed = n_prompt + MAX_TOKENS - 1  # the last sampled token is never computed
    assert st.saved == 0  # nothing was evicted: on disk by write-through
    assert st.written == len(block_files(tmp_path)) == computed // BLOCK
    assert st.writes_dropped == 0
    first.engine.close()  # idempotent

    second = make_llm(tiny_model_dir, kv_offload_dir=str(tmp_path))
    assert second.engine.offload.stats().disk_blocks == computed // BLOCK
    [(tokens, cached)] = run(second, [PROMPT])
    assert tokens == cold[PROMPT][0]
    assert cached == full_hit(n_prompt)
    assert second.engine.offload.stats().loaded_disk == full_hit(n_prompt) // BLOCK
    second.engine.close()


def test_engines_sharing_a_folder_find_each_others_blocks_while_running(
    tiny_model_dir, tmp_path, cold
):
    """Replicas given one --kv-offload-dir: a prefix one computes is loaded, not recomputed, by
    another that was already running when it was written."""
    a = make_llm(tiny_model_dir, kv_offload_dir=str(tmp_path))
    b = make_llm(tiny_model_dir, kv_offload_dir=str(tmp_path))  # started before a writes
    assert b.engine.offload.stats().disk_blocks == 0
    assert run(a, [PROMPT]) == [(cold[PROMPT][0], 0)]
    a.engine.offload.flush()
    [(tokens, cached)] = run(b, [PROMPT])
    assert tokens == cold[PROMPT][0]
    assert cached == full_hit(PROMPT, b)
    assert b.engine.offload.stats().loaded_disk == full_hit(PROMPT, b) // BLOCK
    a.engine.close()
    b.engine.close()


def test_another_model_in_the_same_folder_finds_nothing_of_the_first(tiny_model_dir, tmp_path):
    """Blocks are keyed by every byte of the weights and by the config: a copy whose config.json
    changes RoPE, or whose weights differ only in the middle of the file (a fine-tune), loads none
    of the first model's blocks and answers as it does with no tier."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    rope = tmp_path / "rope"
    shutil.copytree(tiny_model_dir, rope)
    config = json.loads((rope / "config.json").read_text())
    for place in (config, config.get("rope_parameters") or {}):  # either style of config.json
        place["rope_theta"] = place.get("rope_theta", 10000.0) / 100
    (rope / "config.json").write_text(json.dumps(config))
    tuned = tmp_path / "tuned"
    shutil.copytree(tiny_model_dir, tuned)
    weights = load_file(tuned / "model.safetensors")
    names = sorted(n for n in weights if ".self_attn.k_proj." in n)
    weights[names[len(names) // 2]] = -weights[names[len(names) // 2]]  # not at either end
    save_file(weights, tuned / "model.safetensors", metadata={"format": "pt"})

    store = tmp_path / "tier"
    first = make_llm(tiny_model_dir, kv_offload_dir=str(store))
    run(first, [PROMPT])
    first.engine.close()
    assert block_files(store)
    for other in (rope, tuned):
        expected = run(make_llm(other), [PROMPT])[0][0]
        llm = make_llm(other, kv_offload_dir=str(store))
        assert run(llm, [PROMPT]) == [(expected, 0)], other.name
        assert llm.engine.offload.stats().loaded_disk == 0
        llm.engine.close()


def _block_path(llm: LLM, prompt: str, index: int) -> Path:
    block_hash = llm.engine.kv.block_hashes(llm.get_tokenizer().encode(prompt)).hashes[index]
    return llm.engine.offload.disk.dir / f"{block_hash.hex()}{SUFFIX}"


def test_torn_corrupt_and_temp_files_are_rejected_not_loaded(
    tiny_model_dir, tmp_path, cold, caplog
):
    first = make_llm(tiny_model_dir, kv_offload_dir=str(tmp_path))
    run(first, [PROMPT])
    first.engine.close()
    flipped, torn = _block_path(first, PROMPT, 0), _block_path(first, PROMPT, 1)
    raw = bytearray(flipped.read_bytes())
    raw[len(raw) // 2 + 64] ^= 0x10  # one bit of the payload
    flipped.write_bytes(raw)
    torn.write_bytes(torn.read_bytes()[: len(raw) // 2])  # what a torn write would leave
    temp = flipped.with_name(f"{flipped.name}.999999999{TMP_SUFFIX}")  # its writer is gone
    temp.write_bytes(b"half of a block file")
    busy = flipped.with_name(f"{flipped.name}.{os.getpid()}{TMP_SUFFIX}")  # its writer is alive
    busy.write_bytes(b"being written by another engine on this folder")
    with caplog.at_level(logging.WARNING, logger="pagedkv.offload"):
        second = make_llm(tiny_model_dir, kv_offload_dir=str(tmp_path))
        assert not temp.exists() and not torn.exists()  # deleted at start
        assert busy.exists()
        [(tokens, cached)] = run(second, [PROMPT])
    assert "truncated" in caplog.text and "checksum mismatch" in caplog.text
    assert tokens == cold[PROMPT][0] and cached == 0  # the chain starts with the bad block
    st = second.engine.offload.stats()
    assert st.loaded_disk == 0 and st.bad_files == 2
    second.engine.close()  # both blocks computed again and rewritten

    third = make_llm(tiny_model_dir, kv_offload_dir=str(tmp_path))
    [(tokens, cached)] = run(third, [PROMPT])
    assert tokens == cold[PROMPT][0] and cached == full_hit(PROMPT, third)
    third.engine.close()


def test_a_full_write_queue_drops_and_counts_instead_of_waiting(tmp_path, monkeypatch):
    shape = (2, 2, 1, 2, 3)
    tier = DiskTier(tmp_path, b"k", shape, torch.float32, 1 << 20, queue_blocks=1)
    entered, release = threading.Event(), threading.Event()
    write = tier.write

    def slow_write(*args):  # a disk that hangs until released
        entered.set()
        release.wait(30)
        return write(*args)

    monkeypatch.setattr(tier, "write", slow_write)
    hashes = [hash_block_tokens(None, [i, i]) for i in range(5)]
    assert tier.put(hashes[0], (0, 0), torch.zeros(shape))
    assert entered.wait(30)  # the writer holds block 0
    start = time.monotonic()
    results = [
        tier.put(h, (i, i), torch.full(shape, float(i))) for i, h in enumerate(hashes[1:], 1)
    ]
    assert time.monotonic() - start < 5  # never waited on the stuck disk
    assert results == [True, False, False, False] and tier.writes_dropped == 3
    assert tier.contains(hashes[1], (1, 1)) and not tier.contains(hashes[2], (2, 2))
    assert torch.equal(tier.read(hashes[1], (1, 1)), torch.ones(shape))  # its queued copy
    assert tier.put(hashes[1], (1, 1), torch.zeros(shape))  # queued already: not twice, not dropped
    release.set()
    tier.close()
    assert tier.written == 2 and len(block_files(tmp_path)) == 2
    assert not tier.put(hashes[4], (4, 4), torch.zeros(shape))  # closed: dropped
    assert tier.writes_dropped == 4
    again = DiskTier(tmp_path, b"k", shape, torch.float32, 1 << 20)
    assert torch.equal(again.read(hashes[1], (1, 1)), torch.ones(shape))  # the first copy


def test_a_stuck_disk_never_stalls_the_engine_and_its_drops_are_counted(
    tiny_model_dir, tmp_path, cold, monkeypatch
):
    monkeypatch.setattr(disk_tier, "WRITE_QUEUE_BYTES", 0)  # the smallest queue: 8 blocks
    llm = make_llm(tiny_model_dir, kv_offload_dir=str(tmp_path))
    release, gave_up = threading.Event(), []
    write = llm.engine.offload.disk.write

    def hang(*args):  # a disk that hangs until released
        if not release.wait(120):
            gave_up.append(args[0])
        return write(*args)

    monkeypatch.setattr(llm.engine.offload.disk, "write", hang)
    try:
        assert run(llm, [PROMPT, *OTHERS]) == [(cold[p][0], 0) for p in [PROMPT, *OTHERS]]
        dropped = llm.engine.stats().offload_disk_writes_dropped
        assert dropped > 0 and dropped == llm.engine.offload.stats().writes_dropped
    finally:
        release.set()
    assert not gave_up  # the engine finished while the disk still hung
    llm.engine.close()
    written = llm.engine.offload.stats().written
    assert written == len(block_files(tmp_path)) and 8 <= written <= 9  # 8 queued, 1 maybe taken


# ---- a real server -----------------------------------------------------------------------------


def complete(srv: ServerProcess, prompt: str):
    return srv.openai().completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )


def test_server_sigterm_then_restart_serves_the_prompt_from_disk(tiny_model_dir, tmp_path, cold):
    args = (*SERVE, "--kv-offload-dir", str(tmp_path))
    with ServerProcess(tiny_model_dir, *args) as srv:
        first = complete(srv, PROMPT)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert srv.metrics()["pagedkv:kv_offload_disk_writes_dropped_total"] == 0
        srv.terminate()
        assert "Application shutdown complete" in srv.output()
    assert first.choices[0].text == cold[PROMPT][1]
    with ServerProcess(tiny_model_dir, *args) as srv:
        second = complete(srv, PROMPT)
    assert second.choices[0].text == cold[PROMPT][1]
    assert second.usage.prompt_tokens_details.cached_tokens == full_hit(second.usage.prompt_tokens)


def _load(srv: ServerProcess, prompts: list[str]) -> list[threading.Thread]:
    """Requests that keep the writer busy until the server dies under them."""

    def one(prompt: str) -> None:
        try:
            srv.http.post(
                "/v1/completions",
                json={
                    "model": "tiny",
                    "prompt": prompt,
                    "max_tokens": 48,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            )
        except httpx.HTTPError:
            pass

    threads = [threading.Thread(target=one, args=(p,), daemon=True) for p in prompts]
    for t in threads:
        t.start()
    return threads


def _plant_damage(tier_dir: Path, rnd: random.Random) -> list[Path]:
    """A temporary file and a torn block file, as a crash (or a power cut) could leave them."""
    temp = tier_dir / f"{'ab' * 32}{SUFFIX}.999999999{TMP_SUFFIX}"
    temp.write_bytes(b"\0" * 100)
    whole = rnd.choice(block_files(tier_dir)).read_bytes()
    torn = tier_dir / f"{'cd' * 32}{SUFFIX}"
    torn.write_bytes(whole[: rnd.randrange(1, len(whole))])
    return [temp, torn]


def test_kill_9_at_random_moments_never_breaks_a_restart(tiny_model_dir, tmp_path, cold):
    rnd = random.Random(20261201)
    args = (*SERVE, "--kv-offload-dir", str(tmp_path))
    checks = [PROMPT, OTHERS[0]]
    cached_seen = []
    for round_ in range(4):
        planted = _plant_damage(next(tmp_path.iterdir()), rnd) if round_ else []
        srv = ServerProcess(tiny_model_dir, *args)
        try:
            assert not any(p.exists() for p in planted)  # the start deleted them
            for prompt in checks:
                out = complete(srv, prompt)
                assert out.choices[0].text == cold[prompt][1], f"round {round_}: {prompt!r} changed"
                cached_seen.append(out.usage.prompt_tokens_details.cached_tokens)
            _load(srv, OTHERS[1:] + [p + " again" for p in OTHERS])
            time.sleep(rnd.uniform(0.05, 0.8))
            srv.proc.kill()  # SIGKILL: no drain, no cleanup
            srv.proc.wait(30)
        finally:
            srv.http.close()
            srv.close()
    assert any(cached_seen[2:])  # later rounds found what earlier ones wrote
    with ServerProcess(tiny_model_dir, *args) as srv:  # a graceful stop leaves no temporary file
        for prompt in checks:
            assert complete(srv, prompt).choices[0].text == cold[prompt][1]
        srv.terminate()
    assert not list(tmp_path.rglob(f"*{TMP_SUFFIX}"))
    assert block_files(tmp_path)

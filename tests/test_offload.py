"""Tiered KV offload: the host and disk tiers alone, with the manager, and in the engine on a tiny model."""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import random
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedkv import LLM, SamplingParams
from pagedkv.config import ConfigError, EngineConfig
from pagedkv.kv.hashing import hash_block_tokens
from pagedkv.kv.manager import KVCacheManager
from pagedkv.kvstore.block_file import SUFFIX
from pagedkv.kvstore.disk_tier import DiskTier
from pagedkv.kvstore.offload import HostTier, KVOffload
from pagedkv.kvstore.storage import KVStorage

SHAPE = dict(num_layers=2, num_kv_heads=1, block_size=2, head_dim=3, dtype="float32")
BLOCK_SHAPE = (2, 2, 1, 2, 3)
KEY = b"model-abc:torch.float32"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def h(i: int):
    return hash_block_tokens(None, [i, i], b"")


def tokens(i: int) -> tuple[int, ...]:
    return (i, i)


def block(value: float) -> torch.Tensor:
    return torch.full(BLOCK_SHAPE, value)


def host_tier(n: int) -> HostTier:
    return HostTier(KVStorage(num_blocks=n, device="cpu", **SHAPE))


def disk_tier(root, max_bytes: int = 1 << 20, key: bytes = KEY) -> DiskTier:
    return DiskTier(root, key, BLOCK_SHAPE, torch.float32, max_bytes)


def files(tier: DiskTier) -> list[Path]:
    return sorted(tier.dir.iterdir())


# ---- host tier --------------------------------------------------------------------------------


def test_host_tier_evicts_least_recently_used_and_skips_pinned():
    tier = host_tier(2)
    assert tier.insert(h(1), tokens(1)) == (0, None)
    assert tier.insert(h(2), tokens(2)) == (1, None)
    assert tier.touch(h(1)) and tier.order() == [h(2), h(1)]
    slot, (victim, entry) = tier.insert(h(3), tokens(3))  # h2 is the LRU block
    assert victim == h(2) and slot == entry.slot == 1 and tier.order() == [h(1), h(3)]
    tier.pin(h(1))  # a load reads it this step
    slot, (victim, _) = tier.insert(h(4), tokens(4))
    assert victim == h(3) and slot == 1 and tier.order() == [h(1), h(4)]
    assert tier.find(h(1), tokens(1)) == 0
    assert tier.find(h(1), (9, 9)) is None  # same hash, other tokens: no hit
    tier.pin(h(4))
    assert tier.insert(h(5), tokens(5)) is None  # everything pinned
    tier.unpin_all()
    tier.check_integrity([])


def test_host_tier_lends_slots_to_swap_free_ones_first_then_lru():
    tier = host_tier(3)
    tier.insert(h(1), tokens(1))
    tier.insert(h(2), tokens(2))
    tier.pin(h(2))
    assert tier.num_free() == 2  # one free slot + unpinned h1
    lent = tier.take(2)
    assert lent == [2, 0] and [v for v, _ in tier.displaced] == [h(1)] and tier.order() == [h(2)]
    with pytest.raises(ValueError):
        tier.take(1)
    tier.check_integrity(lent)
    tier.release(lent)
    tier.unpin_all()
    assert tier.num_free() == 3
    tier.check_integrity([])


# ---- disk tier --------------------------------------------------------------------------------


def test_disk_tier_round_trip_survives_a_restart_and_leaves_no_temp_files(tmp_path):
    tier = disk_tier(tmp_path)
    assert tier.write(h(1), tokens(1), block(1.5)) and tier.write(h(2), tokens(2), block(2.5))
    assert [p.name for p in files(tier)] == sorted(f"{h(i).hex()}{SUFFIX}" for i in (1, 2))
    assert torch.equal(tier.read(h(1), tokens(1)), block(1.5))
    assert tier.read(h(1), (7, 7)) is None  # token ids are compared too
    again = disk_tier(tmp_path)  # a new engine on the same folder
    assert again.num_blocks == 2 and again.bytes_used == tier.bytes_used
    assert torch.equal(again.read(h(2), tokens(2)), block(2.5))
    other = DiskTier(tmp_path, KEY, (2, 2, 1, 4, 3), torch.float32, 1 << 20)  # another block size
    assert other.dir != tier.dir and other.num_blocks == 0


def test_disk_tier_checksum_mismatch_is_skipped_with_a_warning_and_deleted(tmp_path, caplog):
    tier = disk_tier(tmp_path)
    tier.write(h(1), tokens(1), block(1.0))
    path = files(tier)[0]
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0x40  # one flipped payload bit
    path.write_bytes(raw)
    with caplog.at_level(logging.WARNING, logger="pagedkv.offload"):
        assert tier.read(h(1), tokens(1)) is None
    assert "checksum mismatch" in caplog.text
    assert (
        not path.exists() and tier.num_blocks == 0 and tier.bytes_used == 0 and tier.bad_files == 1
    )


def test_disk_tier_start_up_skips_truncated_foreign_and_stray_files(tmp_path, caplog):
    tier = disk_tier(tmp_path)
    for i in range(4):
        tier.write(h(i), tokens(i), block(float(i)))
    path = {i: tier.dir / f"{h(i).hex()}{SUFFIX}" for i in range(4)}
    path[0].write_bytes(path[0].read_bytes()[:-7])  # truncated
    stranger = disk_tier(tmp_path / "other", key=b"another-model:torch.float32")
    stranger.write(h(1), tokens(1), block(9.0))
    os.replace(files(stranger)[0], path[1])  # another model's file, same name
    path[2].write_bytes(b"garbage, not a block file")
    (tier.dir / f"{h(7).hex()}{SUFFIX}.999999999.tmp").write_bytes(b"half a write")
    with caplog.at_level(logging.WARNING, logger="pagedkv.offload"):
        again = disk_tier(tmp_path)
    assert (
        "truncated" in caplog.text
        and "another-model" in caplog.text
        and "not a pagedkv block file" in caplog.text
    )
    assert again.bad_files == 3 and again.num_blocks == 1
    assert files(again) == sorted([path[1], path[3]])  # the foreign file is left alone
    assert again.read(h(1), tokens(1)) is None
    assert torch.equal(again.read(h(3), tokens(3)), block(3.0))


def test_disk_tier_keeps_under_its_size_limit_dropping_least_recently_used(tmp_path):
    one = disk_tier(tmp_path / "probe")
    one.write(h(0), tokens(0), block(0.0))
    size = one.bytes_used
    tier = disk_tier(tmp_path, max_bytes=2 * size + size // 2)
    tier.write(h(1), tokens(1), block(1.0))
    tier.write(h(2), tokens(2), block(2.0))
    tier.read(h(1), tokens(1))  # h2 is now the LRU block
    tier.write(h(3), tokens(3), block(3.0))
    assert (
        not tier.contains(h(2), tokens(2))
        and tier.contains(h(1), tokens(1))
        and tier.contains(h(3), tokens(3))
    )
    assert (
        sum(p.stat().st_size for p in files(tier)) == tier.bytes_used <= tier.max_bytes
        and tier.dropped == 1
    )
    smaller = disk_tier(tmp_path, max_bytes=size)  # restart with a lower limit
    assert smaller.num_blocks == 1 and len(files(smaller)) == 1


def test_a_full_disk_warns_once_and_the_tier_writes_again_when_it_has_room(
    tmp_path, monkeypatch, caplog
):
    """Writes failing (ENOSPC) drop their blocks with one warning for the run, not one per block
    (a busy server writes thousands); the first write that succeeds again says how many went."""
    tier = disk_tier(tmp_path)
    real_fsync = os.fsync

    def disk_full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", disk_full)
    with caplog.at_level(logging.WARNING, logger="pagedkv.offload"):
        assert not any([tier.write(h(i), tokens(i), block(float(i))) for i in range(5)])
        assert caplog.text.count("No space left on device") == 1
        assert tier.dropped == 5 and tier.bytes_used == 0 and files(tier) == []
        monkeypatch.setattr(os, "fsync", real_fsync)
        assert tier.write(h(5), tokens(5), block(5.0))
        assert tier.write(h(6), tokens(6), block(6.0))
    assert "5 blocks were dropped" in caplog.text and len(caplog.records) == 2
    assert torch.equal(tier.read(h(5), tokens(5)), block(5.0)) and len(files(tier)) == 2


# ---- with the manager: evicted data is saved before it is overwritten, and comes back ----------


def test_evicted_block_is_saved_before_overwrite_and_loaded_back():
    device = KVStorage(num_blocks=3, device="cpu", **SHAPE)
    offload = KVOffload(host_tier(4), None)
    m = KVCacheManager(3, 2, offload=offload, watermark=0.0)
    prompt = [1, 2, 3, 4, 5]  # 2 full blocks + 1 token

    def step(writes: dict[int, float]):
        saves, loads, _ = m.take_offload_plan()
        staged = offload.stage(device, saves, loads)
        offload.commit(device, staged)
        for bid, value in writes.items():  # what the forward pass writes
            device.write_blocks([bid], block(value)[None])
        return saves, loads

    hashes = m.block_hashes(prompt)
    m.allocate_slots("a", hashes, 5)
    step({0: 10.0, 1: 11.0, 2: 12.0})
    m.free("a")
    m.allocate_slots("b", m.block_hashes([7] * 6), 6)  # evicts a's two cached blocks
    saves, loads = step({0: 20.0, 1: 21.0, 2: 22.0})
    assert sorted(s.block_id for s in saves) == [0, 1] and loads == []
    m.free("b")
    prefix = m.lookup_prefix(hashes)
    assert prefix.block_ids == () and prefix.num_offloaded == 2
    m.allocate_slots("a2", hashes, 1, prefix=prefix)
    assert m.num_cached_tokens("a2") == 4 and m.stats().offload_hits == 4
    table = m.block_table("a2")
    saves, loads = step({})
    assert [load.dst for load in loads] == table[:2]
    assert torch.equal(device.read_blocks(table[:2]), torch.stack([block(10.0), block(11.0)]))
    assert offload.stats().loaded_host == 2
    m.check_integrity()


class OffloadMachine(RuleBasedStateMachine):
    """Random engine-like steps on the manager with an offload, against K/V that hold the token ids.

    A step schedules like the scheduler (preempt by swap or recompute, swap in, append, admit with
    device and tier prefix hits) and then moves data like the runner (stage, swap out, CoW, swap in,
    commit, the forward's writes). After every step each running request must read back exactly its
    tokens: a block saved after being overwritten, a load clobbered by swap, a bad tier hit or a
    corrupt file used shows up.
    """

    def __init__(self):
        super().__init__()
        self.m: KVCacheManager | None = None

    @initialize(
        bs=st.sampled_from([1, 2, 4]),
        num_blocks=st.integers(4, 16),
        host=st.integers(0, 8),
        disk=st.booleans(),
        seed=st.integers(0, 2**16),
    )
    def setup(self, bs, num_blocks, host, disk, seed):
        shape = dict(num_layers=1, num_kv_heads=1, block_size=bs, head_dim=1, dtype="float32")
        self.bs = bs
        self.dev = KVStorage(num_blocks=num_blocks, **shape)
        tier = HostTier(KVStorage(num_blocks=host, **shape)) if host else None
        self.dir = tempfile.mkdtemp() if disk or not host else None
        files = (
            DiskTier(self.dir, b"k", self.dev.block_shape, torch.float32, 12 * (600 + 8 * bs))
            if self.dir
            else None
        )
        self.offload = KVOffload(tier, files)
        self.swap = tier.storage if tier is not None else KVStorage(num_blocks=4, **shape)
        self.m = KVCacheManager(
            num_blocks,
            bs,
            num_host_blocks=0 if tier is not None else 4,
            watermark=0.0,
            hash_extra=b"k",
            offload=self.offload,
        )
        rnd = random.Random(seed)
        self.bases = [[rnd.randrange(20) for _ in range(6 * bs)] for _ in range(2)]
        self.known: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.next_id = 0

    def _running(self) -> list[str]:
        return sorted(r for r in self.known if not self.m.is_swapped(r))

    def _swapped(self) -> list[str]:
        return sorted(r for r in self.known if self.m.is_swapped(r))

    def _preempt(self, data, swap_out: list) -> None:
        rid = data.draw(st.sampled_from(self._running()))
        if data.draw(st.booleans()) and self.m.can_swap_out(rid):
            swap_out += self.m.swap_out(rid)
        else:  # recompute: it comes back as a new prompt
            self.m.free(rid)
            del self.known[rid], self.computed[rid]

    def _append(self, data, rid: str, cow: list, writes: list) -> None:
        start = self.computed[rid]
        pending = len(self.known[rid]) - start
        n = data.draw(st.integers(1, pending if pending else 2 * self.bs))
        new = [] if pending else data.draw(st.lists(st.integers(0, 19), min_size=n, max_size=n))
        hashes = self.m.block_hashes(self.known[rid] + new)
        copies = self.m.allocate_slots(rid, hashes, n)
        if copies is not None:
            cow += copies
            self.known[rid] += new
            self.computed[rid] = start + n
            writes.append((rid, start, start + n))

    def _admit(self, data, writes: list) -> None:
        base = self.bases[data.draw(st.integers(0, 1))]
        prompt = base[: data.draw(st.integers(0, len(base)))] + data.draw(
            st.lists(st.integers(0, 19), min_size=1, max_size=2 * self.bs)
        )
        hashes = self.m.block_hashes(prompt)
        prefix = self.m.lookup_prefix(hashes)
        n = data.draw(st.integers(1, len(prompt) - prefix.num_blocks * self.bs))
        rid = f"r{self.next_id}"
        self.next_id += 1
        if self.m.allocate_slots(rid, hashes, n, prefix=prefix) is None:
            return
        cached = self.m.num_cached_tokens(rid)
        assert cached <= prefix.num_blocks * self.bs
        self.known[rid] = list(prompt)
        self.computed[rid] = cached + n
        writes.append((rid, cached, cached + n))

    @precondition(lambda self: self.m is not None)
    @rule(data=st.data())
    def step(self, data):
        swap_out, cow, swap_in, writes = [], [], [], []
        if self._running() and data.draw(st.booleans()):
            self._preempt(data, swap_out)
        if self._swapped() and data.draw(st.booleans()):
            swap_in += self.m.swap_in(data.draw(st.sampled_from(self._swapped()))) or []
        for rid in self._running():
            if data.draw(st.booleans()):
                self._append(data, rid, cow, writes)
        for _ in range(data.draw(st.integers(0, 2))):
            self._admit(data, writes)
        # the runner
        saves, loads, through = self.m.take_offload_plan()
        staged = self.offload.stage(self.dev, saves, loads)
        if swap_out:
            self.swap.write_blocks(
                [c.dst for c in swap_out], self.dev.read_blocks([c.src for c in swap_out])
            )
        self.dev.copy_blocks([(c.src, c.dst) for c in cow])
        if swap_in:
            self.dev.write_blocks(
                [c.dst for c in swap_in], self.swap.read_blocks([c.src for c in swap_in])
            )
        self.offload.commit(self.dev, staged)
        for rid, start, end in writes:  # the forward pass stores each token's K and V
            table = self.m.block_table(rid)
            for p in range(start, end):
                self.dev.data[0, :, table[p // self.bs], 0, p % self.bs, 0] = self.known[rid][p]
        if through:  # blocks just filled go to disk too
            self.offload.write_through(self.dev, through)
        self.offload.flush()  # the disk as the next step finds it: no race

    @precondition(lambda self: self.m is not None and self.dir and self.offload.disk.num_blocks)
    @rule(data=st.data())
    def corrupt_a_file(self, data):
        """Bit rot under the disk tier: the hit that reads it must fall back to computing."""
        path = data.draw(st.sampled_from(sorted(self.offload.disk.dir.iterdir())))
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0x01
        path.write_bytes(raw)

    @precondition(lambda self: self.m is not None and self.known)
    @rule(data=st.data())
    def finish(self, data):
        rid = data.draw(st.sampled_from(sorted(self.known)))
        self.m.free(rid)
        del self.known[rid], self.computed[rid]

    @invariant()
    def reads_back_its_tokens(self):
        if self.m is None:
            return
        self.m.check_integrity()
        for rid in self._running():
            table = self.m.block_table(rid)
            got = [
                self.dev.data[0, :, table[p // self.bs], 0, p % self.bs, 0].tolist()
                for p in range(self.computed[rid])
            ]
            assert got == [[t, t] for t in self.known[rid][: self.computed[rid]]], (
                f"{rid} reads back wrong K/V"
            )

    def teardown(self):
        if self.m is None:
            return
        for rid in list(self.known):
            self.m.free(rid)
        self.m.check_integrity()
        self.offload.close()
        if self.dir:
            shutil.rmtree(self.dir)


OffloadMachine.TestCase.settings = settings(
    max_examples=80,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestOffloadStateful = OffloadMachine.TestCase


# ---- in the engine ----------------------------------------------------------------------------

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
_TEXT = "Memory is cut into fixed-size blocks handed out on demand, mapped by a block table. "
CONVERSATIONS = [f"{name}: " + _TEXT * 2 for name in ("Ann", "Bob", "Cy", "Di")]
OTHERS = [
    f"{i} Hello world! Serving a model means holding each request's cache. {i}" for i in range(4)
]


TINY_BLOCK_BYTES = (
    2048  # the tiny model's block of 4 tokens: 2 layers x K,V x 2 heads x 4 x 16 x fp32
)


def make_llm(model_dir, **options) -> LLM:
    options.setdefault("num_gpu_blocks_override", 24)
    return LLM(model_dir, dtype="float32", block_size=4, max_num_batched_tokens=64, **options)


def run(llm: LLM, prompts):
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], sum(o.num_cached_tokens for o in outs)


def workload(llm: LLM):
    """The conversations, other traffic that evicts them from the small pool, then the conversations again."""
    first, _ = run(llm, CONVERSATIONS)
    other, _ = run(llm, OTHERS)
    again, cached = run(llm, CONVERSATIONS)
    return first + other + again, cached


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    outputs, cached = workload(make_llm(tiny_model_dir))
    return outputs, cached


def assert_clean(llm: LLM) -> None:
    llm.engine.kv.check_integrity()
    assert llm.engine.kv.stats().used == 0


def test_host_tier_serves_evicted_prefixes_without_changing_outputs(tiny_model_dir, reference):
    llm = make_llm(tiny_model_dir, kv_offload_host_memory="1MiB")
    outputs, cached = workload(llm)
    assert outputs == reference[0]
    st = llm.engine.offload.stats()
    assert st.saved > 0 and st.loaded_host > 0 and st.loaded_disk == 0
    assert cached > reference[1]  # fewer prompt tokens computed
    assert llm.engine.kv.stats().offload_hits == 4 * st.loaded_host
    assert_clean(llm)


def test_full_host_tier_spills_to_disk_and_disk_hits_keep_outputs(
    tiny_model_dir, reference, tmp_path
):
    llm = make_llm(
        tiny_model_dir, kv_offload_host_memory=8 * TINY_BLOCK_BYTES, kv_offload_dir=str(tmp_path)
    )
    assert llm.engine.offload.host.num_slots == 8
    outputs, cached = workload(llm)
    assert outputs == reference[0]
    llm.engine.offload.flush()
    st = llm.engine.offload.stats()
    assert st.spilled > 0 and st.disk_blocks > 0 and st.loaded_disk > 0 and st.host_cached == 8
    assert cached > reference[1]
    assert not list(tmp_path.rglob("*.tmp"))
    assert_clean(llm)


def test_restart_finds_the_blocks_the_last_engine_wrote(tiny_model_dir, reference, tmp_path):
    first = make_llm(tiny_model_dir, kv_offload_dir=str(tmp_path))
    run(first, CONVERSATIONS + OTHERS)
    first.engine.close()
    written = first.engine.offload.stats().disk_blocks
    assert written > 0
    second = make_llm(tiny_model_dir, kv_offload_dir=str(tmp_path))
    assert second.engine.offload.stats().disk_blocks == written
    outputs, cached = run(second, CONVERSATIONS)
    assert outputs == reference[0][:4]
    assert second.engine.offload.stats().loaded_disk > 0 and cached > 0


def test_bad_files_are_skipped_with_a_warning_and_outputs_stay_equal(
    tiny_model_dir, reference, tmp_path, caplog
):
    first = make_llm(tiny_model_dir, kv_offload_dir=str(tmp_path))
    run(first, CONVERSATIONS + OTHERS)
    first.engine.close()
    paths = sorted(first.engine.offload.disk.dir.iterdir())
    assert len(paths) >= 6
    paths[0].write_bytes(paths[0].read_bytes()[:100])  # truncated
    foreign = DiskTier(
        tmp_path / "x",
        b"another-model:torch.float32",
        first.engine.storage.block_shape,
        torch.float32,
        1 << 20,
    )
    foreign.write(h(1), tokens(1), torch.zeros(first.engine.storage.block_shape))
    os.replace(next(foreign.dir.iterdir()), paths[1])  # foreign
    for path in paths[2::2]:  # corrupt payloads
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0xFF
        path.write_bytes(raw)
    with caplog.at_level(logging.WARNING, logger="pagedkv.offload"):
        second = make_llm(tiny_model_dir, kv_offload_dir=str(tmp_path))
        outputs, _ = run(second, CONVERSATIONS)
    assert outputs == reference[0][:4]
    assert (
        "truncated" in caplog.text
        and "another-model" in caplog.text
        and "checksum mismatch" in caplog.text
    )
    assert second.engine.offload.stats().bad_files >= 3
    assert_clean(second)


def test_disk_size_limit_is_respected(tiny_model_dir, reference, tmp_path):
    probe = make_llm(tiny_model_dir, kv_offload_dir=str(tmp_path / "probe"))
    run(probe, CONVERSATIONS)
    probe.engine.close()
    limit = (
        10 * probe.engine.offload.stats().disk_bytes // probe.engine.offload.disk.num_blocks
    )  # ten files
    llm = make_llm(
        tiny_model_dir, kv_offload_dir=str(tmp_path / "limited"), kv_offload_disk_size=limit
    )
    outputs, _ = workload(llm)
    assert outputs == reference[0]
    llm.engine.close()
    st = llm.engine.offload.stats()
    used = sum(p.stat().st_size for p in (tmp_path / "limited").rglob(f"*{SUFFIX}"))
    assert st.dropped > 0 and used == st.disk_bytes <= limit


def test_swap_preemption_borrows_the_host_tier(tiny_model_dir, tmp_path, monkeypatch):
    long = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    roomy = make_llm(tiny_model_dir, num_gpu_blocks_override=256)
    expected = [o.outputs[0].token_ids for o in roomy.generate(CONVERSATIONS, long, use_tqdm=False)]
    llm = make_llm(
        tiny_model_dir,
        preemption_mode="swap",
        kv_offload_host_memory=24 * TINY_BLOCK_BYTES,
        kv_offload_dir=str(tmp_path),
    )
    offload = llm.engine.offload
    assert (
        llm.engine.kv.num_host_blocks == 24
        and llm.engine.runner.host_storage is offload.host.storage
    )
    displaced = []
    take = offload.host.take

    def recording_take(n: int) -> list[int]:
        slots = take(n)
        displaced.extend(offload.host.displaced)
        return slots

    monkeypatch.setattr(offload.host, "take", recording_take)
    for _ in range(2):  # the second round finds the first one's blocks in the tiers
        outs = llm.generate(CONVERSATIONS, long, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
    offload.flush()
    st = offload.stats()
    assert llm.engine.scheduler.num_preemptions > 0 and st.loaded_host + st.loaded_disk > 0
    assert displaced and all(
        offload.disk.contains(bh, e.token_ids) for bh, e in displaced
    )  # pushed to disk
    assert_clean(llm)
    assert llm.engine.kv.stats().host_free == 24


def test_swap_space_beside_a_host_tier_is_noted_as_unused(capsys):
    """Swap borrows the host tier's slots: a --swap-space given with it would be ignored unsaid."""
    EngineConfig(preemption_mode="swap", kv_offload_host_memory="1MiB")
    assert "swap-space" not in capsys.readouterr().err
    EngineConfig(preemption_mode="swap", swap_space=16, kv_offload_host_memory="1MiB")
    assert "--swap-space has no effect with --kv-offload-host-memory" in capsys.readouterr().err


def test_offload_flags_too_small_for_one_block_are_config_errors(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="kv-offload-host-memory"):
        make_llm(tiny_model_dir, kv_offload_host_memory=100)
    for swap_space in (0, "100B"):  # swap mode with no room to swap to, not one block anyway
        with pytest.raises(ConfigError, match="--swap-space .* holds no KV block"):
            make_llm(tiny_model_dir, preemption_mode="swap", swap_space=swap_space)
    make_llm(tiny_model_dir, swap_space=0)  # recompute needs none
    with pytest.raises(ConfigError, match="kv-offload-disk-size"):
        make_llm(tiny_model_dir, kv_offload_dir=str(tmp_path), kv_offload_disk_size=100)
    # room for the payload but not the header: no file would ever fit
    payload = TINY_BLOCK_BYTES
    with pytest.raises(ConfigError, match="kv-offload-disk-size .* holds no KV block"):
        make_llm(tiny_model_dir, kv_offload_dir=str(tmp_path), kv_offload_disk_size=payload)
    fits = make_llm(
        tiny_model_dir, kv_offload_dir=str(tmp_path), kv_offload_disk_size=payload + 4096
    )
    run(fits, CONVERSATIONS[:1])
    fits.engine.close()
    assert fits.engine.offload.stats().written > 0  # the smallest size accepted holds a file


def test_offload_folder_flags_that_would_do_nothing_are_config_errors(tmp_path, monkeypatch):
    """`--kv-offload-dir "$DIR"` with DIR unset, and a disk size with no folder, would run
    without the tier the user asked for, and a folder without prefix caching would stay empty;
    `~` means the home folder, as for --model."""
    with pytest.raises(ConfigError, match="kv-offload-dir needs a folder"):
        EngineConfig(kv_offload_dir="")
    with pytest.raises(ConfigError, match="needs --kv-offload-dir"):
        EngineConfig(kv_offload_disk_size="1GiB")
    with pytest.raises(ConfigError, match="kv-offload-dir keeps prefix-cache blocks"):
        EngineConfig(kv_offload_dir=str(tmp_path), enable_prefix_caching=False)
    assert EngineConfig().kv_offload_disk_size is None
    monkeypatch.setenv("HOME", str(tmp_path))
    config = EngineConfig(kv_offload_dir="~/tier")
    assert config.kv_offload_dir == str(tmp_path / "tier")
    assert config.kv_offload_disk_size == 10 * 2**30
    assert (
        dataclasses.replace(config, kv_offload_dir=str(tmp_path)).kv_offload_disk_size == 10 * 2**30
    )


def test_offload_folder_may_be_a_path_object_and_nothing_else(tiny_model_dir, tmp_path):
    """LLM(kv_offload_dir=Path(...)) as LLM(Path(model)) takes one; a number is a ConfigError,
    not an AttributeError from inside the config."""
    llm = make_llm(tiny_model_dir, kv_offload_dir=tmp_path / "tier")
    assert llm.engine.offload.disk.dir.parent == tmp_path / "tier"
    for bad in (123, b"/tmp/tier"):
        with pytest.raises(ConfigError, match="kv-offload-dir must be a string or a path"):
            EngineConfig(kv_offload_dir=bad)


def test_an_unwritable_offload_folder_is_refused_at_start(tiny_model_dir, tmp_path):
    """Not a warning per block while serving, with nothing kept for a restart."""
    first = make_llm(tiny_model_dir, kv_offload_dir=str(tmp_path))
    first.engine.close()
    folder = first.engine.offload.disk.dir
    folder.chmod(0o555)
    locked = (  # root ignores the mode: make it immutable
        os.access(folder, os.W_OK)
        and shutil.which("chattr") is not None
        and not subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode
    )
    try:
        if os.access(folder, os.W_OK):
            pytest.skip("cannot make a folder read-only here")
        with pytest.raises(ConfigError, match="kv-offload-dir: cannot write .*(denied|permitted)"):
            make_llm(tiny_model_dir, kv_offload_dir=str(tmp_path))
    finally:
        if locked:
            subprocess.run(["chattr", "-i", str(folder)])
        folder.chmod(0o755)


def test_a_fifo_named_like_a_block_file_is_skipped_not_waited_on(tmp_path):
    """Opening a FIFO blocks until a writer comes: the tier must never hang on one."""
    first = disk_tier(tmp_path)
    first.close()
    fifo = first.dir / f"{h(1).hex()}{SUFFIX}"
    os.mkfifo(fifo)
    done = threading.Event()
    found: list[DiskTier] = []
    threading.Thread(
        target=lambda: (found.append(disk_tier(tmp_path)), done.set()), daemon=True
    ).start()
    assert done.wait(30), "the scan hung on the FIFO"
    again = found[0]
    assert again.num_blocks == 0 and again.bad_files == 1 and fifo.exists()  # not ours: kept
    assert not again.contains(h(1), tokens(1))  # looked up again while serving: no hang either
    again.close()

"""Thousands of random block-manager operations against a model of the data the blocks hold.

Besides `check_integrity()` (free xor referenced, ref count == tables holding
the block, no duplicates in the free queue, only full blocks hashed), the machine
keeps a fake device and host memory: it writes every computed token into its
slot and applies every BlockCopy plan. After each step each running request's
table must read back exactly its tokens, so a wrong CoW, a bad prefix hit, a
block reused while still held or a wrong swap plan shows up as wrong data.
Each request's block hashes are extended as its tokens arrive, as the engine's
sequences do, and must always equal its tokens hashed from scratch.
"""

import random

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedkv.kv import BlockHashes, KVCacheManager


class KVMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.m: KVCacheManager | None = None

    @initialize(
        block_size=st.sampled_from([1, 2, 4]),
        num_blocks=st.integers(3, 40),
        num_host=st.integers(0, 16),
        caching=st.booleans(),
        policy=st.sampled_from(["paged", "paged", "reserve-max", "reserve-output"]),
        watermark=st.sampled_from([0.0, 0.1]),
        seed=st.integers(0, 2**16),
    )
    def setup(self, block_size, num_blocks, num_host, caching, policy, watermark, seed):
        self.bs = block_size
        self.m = KVCacheManager(
            num_blocks,
            block_size,
            num_host_blocks=num_host,
            enable_prefix_caching=caching,
            allocation_policy=policy,
            max_model_len=block_size * 6,
            watermark=watermark,
            hash_extra=b"test",
            on_evict=self._on_evict,
        )
        self.dev = [[None] * block_size for _ in range(num_blocks)]
        self.host = [[None] * block_size for _ in range(num_host)]
        self.known: dict[str, list[int]] = {}  # every request's known tokens (prompt + generated)
        self.computed: dict[str, int] = {}
        self.hashes: dict[str, BlockHashes] = {}  # every request's, extended as tokens arrive
        self.waiting: list[list[int]] = []  # preempted for recompute
        rnd = random.Random(seed)
        self.bases = [[rnd.randrange(50) for _ in range(8 * block_size)] for _ in range(3)]
        self.next_id = 0

    def _on_evict(self, block_id, block_hash):
        block = self.m.pool.blocks[block_id]
        assert block.ref_count == 0 and block.block_hash == block_hash
        event("evict")

    # ---- helpers ----------------------------------------------------------------------------

    def _write(self, rid: str, start: int, end: int) -> None:
        """What the forward pass does: store each computed token in its slot."""
        table = self.m.block_table(rid)
        for p in range(start, end):
            self.dev[table[p // self.bs]][p % self.bs] = self.known[rid][p]

    def _apply(self, copies, src_mem, dst_mem) -> None:
        for c in copies:
            dst_mem[c.dst] = list(src_mem[c.src])

    def _running(self):
        return sorted(r for r in self.known if not self.m.is_swapped(r))

    def _swapped(self):
        return sorted(r for r in self.known if self.m.is_swapped(r))

    # ---- rules ------------------------------------------------------------------------------

    @precondition(lambda self: self.m is not None)
    @rule(data=st.data())
    def admit(self, data):
        if self.waiting and data.draw(st.booleans()):
            prompt = self.waiting.pop(data.draw(st.integers(0, len(self.waiting) - 1)))
        else:
            base = self.bases[data.draw(st.integers(0, 2))]
            cut = data.draw(st.integers(0, len(base)))
            tail = data.draw(
                st.lists(st.integers(0, 49), min_size=0 if cut else 1, max_size=3 * self.bs)
            )
            prompt = base[:cut] + tail
        hashes = self.m.block_hashes(prompt)
        prefix = self.m.lookup_prefix(hashes)
        remaining = len(prompt) - prefix.num_blocks * self.bs
        num_new = data.draw(st.integers(1, remaining))  # chunked prefill when < remaining
        max_tokens = data.draw(st.integers(1, 3 * self.bs))
        rid = f"r{self.next_id}"
        self.next_id += 1
        before = self.m.snapshot()
        out = self.m.allocate_slots(rid, hashes, num_new, prefix=prefix, max_tokens=max_tokens)
        if out is None:
            assert self.m.snapshot() == before and not self.m.has_request(rid)
            event("admit refused")
            return
        assert out == []
        event("admit with prefix hit" if prefix.block_ids else "admit")
        cached = self.m.num_cached_tokens(rid)
        assert cached == prefix.num_blocks * self.bs
        self.known[rid] = list(prompt)
        self.hashes[rid] = hashes
        self.computed[rid] = cached + num_new
        self._write(rid, cached, cached + num_new)

    @precondition(lambda self: self.m is not None and self._running())
    @rule(data=st.data())
    def step(self, data):
        """Continue a prefill chunk, or decode new tokens (maybe into a block shared after a
        fork)."""
        rid = data.draw(st.sampled_from(self._running()))
        start = self.computed[rid]
        pending = len(self.known[rid]) - start
        if pending:
            n = data.draw(st.integers(1, pending))
            new_tokens = []
        else:
            n = data.draw(st.integers(1, 2 * self.bs))
            new_tokens = data.draw(st.lists(st.integers(0, 49), min_size=n, max_size=n))
        hashes = self.hashes[rid]
        if new_tokens:  # kept only if the step is taken
            hashes = hashes.copy()
            hashes.update(self.known[rid] + new_tokens)
        before = self.m.snapshot()
        out = self.m.allocate_slots(rid, hashes, n)
        if out is None:
            assert self.m.snapshot() == before
            event("step refused")
            return
        if out:
            event("copy-on-write")
        self._apply(out, self.dev, self.dev)
        self.known[rid] += new_tokens
        self.hashes[rid] = hashes
        self.computed[rid] = start + n
        self._write(rid, start, start + n)

    @precondition(lambda self: self.m is not None and self._running())
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self._running()))
        child = f"r{self.next_id}"
        self.next_id += 1
        self.m.fork(parent, child)
        self.known[child] = list(self.known[parent])
        self.hashes[child] = self.hashes[parent].copy()
        self.computed[child] = self.computed[parent]
        assert self.m.block_table(child) == self.m.block_table(parent)

    @precondition(lambda self: self.m is not None and self.known)
    @rule(data=st.data(), recompute=st.booleans())
    def free(self, data, recompute):
        """Finish or abort a request, or preempt it for recompute (it comes back through admit)."""
        rid = data.draw(st.sampled_from(sorted(self.known)))
        self.m.free(rid)
        tokens = self.known.pop(rid)
        del self.computed[rid], self.hashes[rid]
        if recompute:
            self.waiting.append(tokens)
        assert not self.m.has_request(rid)

    @precondition(lambda self: self.m is not None and self._running())
    @rule(data=st.data())
    def swap_out(self, data):
        rid = data.draw(st.sampled_from(self._running()))
        before = self.m.snapshot()
        can = self.m.can_swap_out(rid)
        out = self.m.swap_out(rid)
        if out is None:
            assert not can and self.m.snapshot() == before
            event("swap out refused")
            return
        event("swap out")
        self._apply(out, self.dev, self.host)
        assert self.m.is_swapped(rid) and self.m.block_table(rid) == []
        assert self.m.num_computed_tokens(rid) == self.computed[rid]

    @precondition(lambda self: self.m is not None and self._swapped())
    @rule(data=st.data())
    def swap_in(self, data):
        rid = data.draw(st.sampled_from(self._swapped()))
        before = self.m.snapshot()
        out = self.m.swap_in(rid)
        if out is None:
            assert self.m.snapshot() == before and self.m.is_swapped(rid)
            event("swap in refused")
            return
        event(
            "swap in reusing cached blocks"
            if len(out) < -(-self.computed[rid] // self.bs)
            else "swap in"
        )
        self._apply(out, self.host, self.dev)

    @precondition(lambda self: self.m is not None)
    @rule(data=st.data())
    def lookup(self, data):
        """A prefix hit must point at blocks that really hold those tokens; the lookup changes
        nothing."""
        base = self.bases[data.draw(st.integers(0, 2))]
        prompt = base[: data.draw(st.integers(0, len(base)))] + data.draw(
            st.lists(st.integers(0, 49), max_size=4)
        )
        before = self.m.snapshot()
        hit = self.m.lookup_prefix(self.m.block_hashes(prompt)).block_ids
        assert self.m.snapshot() == before
        assert len(hit) * self.bs < max(len(prompt), 1)
        for i, bid in enumerate(hit):
            assert self.dev[bid] == prompt[i * self.bs : (i + 1) * self.bs]

    @precondition(lambda self: self.m is not None)
    @rule()
    def reset_prefix_cache(self):
        busy = self.m.usage() > 0
        assert self.m.reset_prefix_cache() is (not busy)
        if not busy:
            assert self.m.stats().cached == 0

    # ---- invariants -------------------------------------------------------------------------

    @invariant()
    def consistent(self):
        if self.m is None:
            return
        self.m.check_integrity()
        st_ = self.m.stats()
        assert st_.free + st_.used == st_.num_blocks and 0 <= st_.cached <= st_.free
        assert st_.num_requests == len(self.known)
        for rid in self._running():
            n = self.computed[rid]
            assert self.m.num_computed_tokens(rid) == n
            table = self.m.block_table(rid)
            got = [self.dev[table[p // self.bs]][p % self.bs] for p in range(n)]
            assert got == self.known[rid][:n], f"{rid} reads back wrong tokens"
            hashes = self.hashes[rid]
            for i, bid in enumerate(table):
                cached = self.m.pool.blocks[bid].block_hash
                assert cached is None or cached == hashes.hashes[i], f"{rid}: foreign hash at {i}"
        for rid, hashes in self.hashes.items():  # grown token by token == hashed at once
            fresh = self.m.block_hashes(self.known[rid])
            assert (hashes.hashes, hashes.chunks) == (fresh.hashes, fresh.chunks), rid
            assert hashes.num_tokens == len(self.known[rid])

    def teardown(self):
        if self.m is None:
            return
        for rid in list(self.known):
            self.m.free(rid)
        self.m.check_integrity()
        st_ = self.m.stats()
        assert st_.free == st_.num_blocks and st_.used == 0 and st_.host_free == st_.host_blocks


KVMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestKVStateful = KVMachine.TestCase

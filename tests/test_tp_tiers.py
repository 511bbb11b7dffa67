"""The KV offload tiers under tensor parallelism: every rank keeps its own heads' blocks in its own
host tier and disk folder, moved as rank 0 plans; outputs equal -tp 1, and a block that one rank
cannot load is a miss on every rank (recomputed), never mixed K/V."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_offload import (
    CONVERSATIONS,
    OTHERS,
    TINY_BLOCK_BYTES,
    assert_clean,
    make_llm,
    run,
    workload,
)

from pagedkv import LLM, SamplingParams
from pagedkv.kvstore.block_file import SUFFIX

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LONG = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """-tp 1 with no tier: the outputs every run below must give."""
    outputs, _ = workload(make_llm(tiny_model_dir))
    roomy = make_llm(tiny_model_dir, num_gpu_blocks_override=256)
    swapped = [o.outputs[0].token_ids for o in roomy.generate(CONVERSATIONS, LONG, use_tqdm=False)]
    return outputs, swapped


def tp2(model_dir, **options) -> LLM:
    return make_llm(model_dir, tensor_parallel_size=2, **options)


def test_tp2_host_tier_prefix_hits_and_swap_equal_tp1(tiny_model_dir, reference, tmp_path):
    llm = tp2(tiny_model_dir, kv_offload_host_memory="1MiB")
    try:
        outputs, cached = workload(llm)
        assert outputs == reference[0]
        st = llm.engine.offload.stats()
        assert st.saved > 0 and st.loaded_host > 0 and cached > 0
        assert_clean(llm)
    finally:
        llm.engine.close()
    # swap borrows the host tier's slots (evicting cached blocks to disk) on every rank alike
    llm = tp2(
        tiny_model_dir,
        preemption_mode="swap",
        kv_offload_host_memory=24 * TINY_BLOCK_BYTES,
        kv_offload_dir=str(tmp_path),
    )
    try:
        for _ in range(2):  # the second round finds the first one's blocks in the tiers
            outs = llm.generate(CONVERSATIONS, LONG, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outs] == reference[1]
        st = llm.engine.offload.stats()
        assert llm.engine.scheduler.num_preemptions > 0 and st.loaded_host > 0 and st.spilled > 0
        assert_clean(llm)
    finally:
        llm.engine.close()


def files(folder: Path) -> list[Path]:
    return sorted(folder.glob(f"*{SUFFIX}"))


def test_tp2_disk_tier_per_rank_restart_and_a_block_one_rank_lacks(
    tiny_model_dir, reference, tmp_path
):
    first = tp2(tiny_model_dir, kv_offload_dir=str(tmp_path))
    run(first, CONVERSATIONS + OTHERS)
    first.engine.close()
    rank0 = first.engine.offload.disk.dir
    (rank1,) = [p for p in tmp_path.iterdir() if p != rank0]  # one folder per rank
    assert [p.name for p in files(rank0)] == [p.name for p in files(rank1)] != []

    second = tp2(tiny_model_dir, kv_offload_dir=str(tmp_path))
    try:
        outputs, cached = run(second, CONVERSATIONS)
        assert outputs == reference[0][:4]
        assert second.engine.offload.stats().loaded_disk > 0 and cached > 0
    finally:
        second.engine.close()
    tp1 = make_llm(tiny_model_dir, kv_offload_dir=str(tmp_path))
    assert tp1.engine.offload.stats().disk_blocks == 0  # another TP size never reads them
    tp1.engine.close()

    # rank 1 loses its files (deleted, corrupt); rank 0 still reads its own: all recompute
    for i, path in enumerate(files(rank1)):
        if i % 2:
            path.unlink()
        else:
            raw = bytearray(path.read_bytes())
            raw[-1] ^= 0xFF
            path.write_bytes(raw)
    third = tp2(tiny_model_dir, kv_offload_dir=str(tmp_path))
    try:
        outputs, cached = run(third, CONVERSATIONS)
        assert outputs == reference[0][:4]
        assert third.engine.offload.stats().loaded_disk == 0 and cached == 0
        assert files(rank0)  # rank 0's files were fine: kept
        assert_clean(third)
    finally:
        third.engine.close()
    # the recomputed blocks were written again where missing: the next engine loads them
    fourth = tp2(tiny_model_dir, kv_offload_dir=str(tmp_path))
    try:
        outputs, cached = run(fourth, CONVERSATIONS)
        assert outputs == reference[0][:4]
        assert fourth.engine.offload.stats().loaded_disk > 0 and cached > 0
    finally:
        fourth.engine.close()


def test_tp2_ranks_share_the_disk_size_limit(tiny_model_dir, reference, tmp_path):
    """--kv-offload-disk-size bounds the folder, not each rank's part of it."""
    limit = 40_000  # about twenty of -tp 2's files, fewer than the workload writes
    llm = tp2(tiny_model_dir, kv_offload_dir=str(tmp_path), kv_offload_disk_size=limit)
    try:
        outputs, _ = run(llm, CONVERSATIONS + OTHERS)
        assert outputs == reference[0][:8]
    finally:
        llm.engine.close()
    used = sum(p.stat().st_size for p in tmp_path.rglob(f"*{SUFFIX}"))
    assert 0 < used <= limit and llm.engine.offload.stats().dropped > 0

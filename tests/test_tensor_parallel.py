"""Tensor parallelism: outputs equal -tp 1, with preemption, swap, prefix caching and quantized KV;
a rank that dies stops the engine with a clear error instead of a hang. Quantized weights:
test_tp_quant.py; the offload tiers: test_tp_tiers.py."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from server_process import REPO
from tiny_model import EXPERT_FAMILIES, make_tiny_model

from pagedkv import LLM, SamplingParams
from pagedkv.config import ConfigError
from pagedkv.distributed.group import TensorParallelError
from pagedkv.distributed.shard import split_heads

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [
    "hello world",
    "the cache is paged",
    "a b c d e f g",
    "once upon a time there was a block",
    "the cache is paged and shared",
    "hello world again",
]


def greedy(llm: LLM, n: int = 1, max_tokens: int = 24) -> list[list[list[int]]]:
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, n=n, ignore_eos=True)
    return [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS, sp, use_tqdm=False)]


def compare(path: str, world: int, **options) -> None:
    ref = greedy(LLM(path, dtype="float32", **options))
    llm = LLM(path, dtype="float32", tensor_parallel_size=world, **options)
    try:
        assert greedy(llm) == ref
        assert llm.engine.kv_snapshot()["used"] == 0  # every block came back
    finally:
        llm.engine.close()


def test_split_heads_as_vllm():
    assert [split_heads(9, 3, r, 3) for r in range(3)] == [
        split_heads(9, 3, 0, 3).__class__(range(3 * r, 3 * r + 3), range(r, r + 1))
        for r in range(3)
    ]
    # fewer KV heads than ranks: each rank keeps the one its query heads read
    assert [tuple(split_heads(4, 1, r, 2).kv_heads) for r in range(2)] == [(0,), (0,)]
    assert [tuple(split_heads(8, 2, r, 4).kv_heads) for r in range(4)] == [(0,), (0,), (1,), (1,)]
    with pytest.raises(ConfigError, match="does not divide"):
        split_heads(9, 3, 0, 2)


def test_tp2_equals_tp1(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("tp") / "m", heads=4, kv_heads=2)
    compare(path, 2, num_gpu_blocks_override=64, block_size=4)


@pytest.mark.parametrize(
    "arch",
    ["qwen2", "qwen3", "phi3", "smollm3", "granite", "gemma2", "gemma3"]
    + [f for f in EXPERT_FAMILIES if f != "olmoe"],  # (OLMoE's norms span every head: refused)
)
def test_tp2_equals_tp1_for_other_families(arch, tmp_path_factory):
    """Qwen2's q/k/v bias is cut with the projection's rows; Qwen3's per-head norms are whole;
    Phi-3's q/k/v and gate/up, fused in its checkpoint, are cut as ours; Gemma's norms of the
    attention's and the MLP's outputs come after the all-reduce, whole; Gemma 2's soft-capped
    scores on each rank's heads, its logits' cap on the whole; a mixture's router whole on every
    rank, each expert (and Qwen2-MoE's shared one) cut as an MLP, Qwen3-MoE's dense layer too."""
    path = make_tiny_model(tmp_path_factory.mktemp(arch) / "m", heads=4, kv_heads=2, arch=arch)
    compare(path, 2, num_gpu_blocks_override=64, block_size=4)


def test_tp2_equals_tp1_under_longrope_on_part_of_each_head(tmp_path_factory):
    """Phi-4-mini's RoPE (LongRoPE's long set, on 3/4 of each head) on each rank's heads."""
    folder = make_tiny_model(
        tmp_path_factory.mktemp("phi4") / "m", heads=4, kv_heads=2, arch="phi3"
    )
    path = Path(folder)
    cfg = json.loads((path / "config.json").read_text())
    cfg["original_max_position_embeddings"] = 16
    cfg["rope_parameters"] = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.75,
        "short_factor": [1.0] * 6,
        "long_factor": [1.0 + i for i in range(6)],
    }
    (path / "config.json").write_text(json.dumps(cfg))
    compare(str(path), 2, num_gpu_blocks_override=64, block_size=4)


def test_tp2_under_preemption_swap_and_quantized_kv(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("tp") / "m", heads=4, kv_heads=2)
    # 12 blocks of 4 tokens for 6 prompts of ~10 + 24 tokens: requests are preempted and resumed
    compare(
        path,
        2,
        num_gpu_blocks_override=12,
        block_size=4,
        preemption_mode="swap",
        swap_space="64MiB",
    )
    compare(path, 2, num_gpu_blocks_override=12, block_size=4, preemption_mode="recompute")
    compare(path, 2, num_gpu_blocks_override=64, block_size=4, kv_cache_dtype="int8")


def test_tp2_with_replicated_kv_heads(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("tp") / "m", heads=4, kv_heads=1)
    compare(path, 2, num_gpu_blocks_override=64, block_size=4)


def test_a_dead_rank_is_an_error_not_a_hang(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("tp") / "m", heads=4, kv_heads=2)
    llm = LLM(path, dtype="float32", tensor_parallel_size=2, num_gpu_blocks_override=64)
    try:
        (worker,) = llm.engine.tp.procs
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match="rank 1 exited"):
            llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        assert time.monotonic() - start < 120
    finally:
        llm.engine.close()


@pytest.mark.slow
@pytest.mark.parametrize("quantization", [None, "none"])  # None: the GGUF's own blocks (gguf)
def test_default_model_tp3_equals_tp1(quantization):
    """SmolLM2-135M: 9 query heads and 3 KV heads, one KV head per rank."""
    prompts = ["The capital of France is", "Paged attention splits the KV cache into"]
    sp = SamplingParams(temperature=0, max_tokens=16)
    options = dict(dtype="float32", quantization=quantization, kv_cache_memory="256MiB")
    ref = [o.outputs[0].token_ids for o in LLM(**options).generate(prompts, sp, use_tqdm=False)]
    llm = LLM(tensor_parallel_size=3, **options)
    try:
        assert llm.engine.loaded.quantization == (quantization or "gguf")
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == ref
    finally:
        llm.engine.close()


def test_bench_runs_tp2_twice(tmp_path_factory):
    """`pagedkv bench -tp 2` over two workloads builds two engines: the second must not reuse rank
    0's model, which the first cut in place."""
    from pagedkv.bench.offline import EngineFactory

    path = make_tiny_model(tmp_path_factory.mktemp("tiny"))
    factory = EngineFactory({"model": path, "dtype": "float32", "tensor_parallel_size": 2})
    outputs = []
    for _ in range(2):
        engine = factory.build(num_gpu_blocks_override=64)
        try:
            engine.add_request("r", PROMPTS[1], SamplingParams(temperature=0, max_tokens=8))
            while engine.has_unfinished():
                done = [o for o in engine.step() if o.finished]
            outputs.append(done[0].outputs[0].token_ids)
        finally:
            engine.close()
    assert outputs[0] == outputs[1] and len(outputs[0]) == 8


# rank 0 spawns its worker as TensorParallelGroup does, then is killed before it joins the group
LOST_RANK_0 = """
    import os, sys, time
    import torch.multiprocessing as mp
    from pagedkv.config import EngineConfig
    from pagedkv.distributed.group import _worker_main
    config = EngineConfig(model=sys.argv[1], tensor_parallel_size=2, dtype="float32")
    init = "file://" + os.path.join(sys.argv[2], "rendezvous")
    worker = mp.get_context("spawn").Process(
        target=_worker_main, args=(1, 2, init, config, os.getpid()), daemon=True
    )
    worker.start()
    print(worker.pid, flush=True)
    time.sleep(600)
"""


def test_a_worker_leaves_when_rank_0_dies_before_the_ranks_meet(tmp_path_factory):
    """kill -9 (or the OOM killer) on rank 0 at any moment leaves no worker waiting out the
    collectives' 10-minute timeout."""
    path = make_tiny_model(tmp_path_factory.mktemp("tp") / "m", heads=4, kv_heads=2)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    code = textwrap.dedent(LOST_RANK_0)
    rank0 = subprocess.Popen(
        [sys.executable, "-c", code, path, str(tmp_path_factory.mktemp("rdv"))],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert rank0.stdout is not None
        worker = int(rank0.stdout.readline())
        time.sleep(5)  # it waits for rank 0 in init_process_group
        assert os.path.exists(f"/proc/{worker}")
    finally:
        rank0.kill()
        rank0.wait()
    deadline = time.monotonic() + 20
    while _running(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _running(worker):
        os.kill(worker, signal.SIGKILL)
        pytest.fail("the worker outlived rank 0")


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for init to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize(
    "args",
    [
        ["serve", "--port", "0"],
        ["generate", "--prompt", "hello"],
        ["bench", "--workloads", "W1", "--no-progress"],
    ],
    ids=lambda args: args[0],
)
def test_sigterm_while_loading_stops_the_workers_and_deletes_their_folder(tmp_path_factory, args):
    """`pagedkv serve -tp 2` stopped by SIGTERM while it loads (a supervisor giving up, a rollout
    undone) exits with status 143, no worker left and no rendezvous folder; the signal's default
    action left both behind. So do `pagedkv generate` and `pagedkv bench`, which had no handler."""
    import psutil

    path = make_tiny_model(tmp_path_factory.mktemp("tp") / "m", heads=4, kv_heads=2)
    tmp = tmp_path_factory.mktemp("tmpdir")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp)}
    command = ["-m", "pagedkv.cli", *args, "--model", path, "-tp", "2"]
    server = subprocess.Popen([sys.executable, *command], env=env, cwd=tmp, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        workers: list[psutil.Process] = []
        while not (list(tmp.glob("pagedkv-tp-*")) and workers) and time.monotonic() < deadline:
            assert server.poll() is None, server.stderr.read() if server.stderr else ""
            workers = psutil.Process(server.pid).children(recursive=True)
            time.sleep(0.02)
        assert workers, "the workers never started"
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=120) == 143
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    gone, alive = psutil.wait_procs(workers, timeout=30)
    for p in alive:
        p.kill()
    assert not alive, f"a worker outlived `pagedkv {args[0]}`"
    assert list(tmp.glob("pagedkv-tp-*")) == []


# a rank in min_over_ranks while the other takes its time (at load: a worker loading its shard)
SLOW_RANK = """
    import datetime, signal, sys, time
    import torch.distributed as dist
    from pagedkv.distributed.group import min_over_ranks

    def stop(signum, frame):  # as serve()'s
        print("stopping", flush=True)
        sys.exit(128 + signum)

    rank, init = int(sys.argv[1]), sys.argv[2]
    signal.signal(signal.SIGTERM, stop)
    timeout = datetime.timedelta(seconds=90)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=timeout)
    if rank == 1:
        time.sleep(600)
    print("waiting", flush=True)
    try:
        min_over_ranks(1, poll_s=0.05)
    finally:  # as serve()'s exit (_stop): the group goes before the interpreter does
        dist.destroy_process_group()
"""


def test_sigterm_is_handled_while_the_ranks_wait_to_size_the_pool(tmp_path):
    """Rank 0 waits in min_over_ranks until the slowest worker has loaded its shard (10+ s for the
    default model at -tp 3 on 2 cores): a SIGTERM's handler runs meanwhile. Blocked in one
    all_reduce call, it ran only once the workers came, too late for a supervisor's grace."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    init = f"file://{tmp_path / 'rendezvous'}"
    code = textwrap.dedent(SLOW_RANK)
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(r), init], env=env, stdout=subprocess.PIPE
        )
        for r in (0, 1)
    ]
    try:
        out = ranks[0].stdout
        assert out is not None
        assert out.readline() == b"waiting\n"
        time.sleep(1)  # into the wait
        ranks[0].send_signal(signal.SIGTERM)
        assert select.select([out], [], [], 30)[0], "the handler did not run"
        assert out.readline() == b"stopping\n"
        # as serve()'s exit kills the workers, failing the all_reduce still pending. Left pending
        # into the interpreter's own teardown, its failure aborted rank 0 now and then (SIGABRT,
        # "terminate called without an active exception"): _stop destroys the group first.
        ranks[1].kill()
        assert ranks[0].wait(timeout=30) == 143
    finally:
        for p in ranks:
            p.kill()
            p.wait()

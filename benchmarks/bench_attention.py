"""Decode attention over block tables, one layer, against the memory bound.

The W1-like case of shared/bench/README.md: 64 requests with contexts 100..900, 9 query heads,
3 KV heads, head dim 64, 16-token blocks scattered through the pool. Each way runs over several
layers' caches in turn so that the K/V come from memory, not from the last-level cache.

    python benchmarks/bench_attention.py [--requests 64] [--dtypes float32,bfloat16] [--cpu-time]

Two more columns set the kernel beside what it cannot avoid: "runs read alone" reads the same K/V
lines in the kernel's order with no arithmetic (benchmarks/read_runs.cpp, compiled here), the cost
of the access pattern itself; "K/V in cache" times the kernel with every table entry pointing at
one of two blocks, so that K/V stay in L1/L2: its arithmetic alone. The machine's read rate can
swing by 2x from one second to the next where other guests share it, so besides the best kernel
time against the best read ("kernel / bound"), each round's kernel time is set against the read
timed right after it (median and range over the rounds).

The kernel is the variant for the best vector ISA of this CPU; PAGEDKV_CPU_ISA=avx2 (or avx512,
neon, portable) times another (see pagedkv/native.py).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from attention_args import add_attention_args, parse_timed  # same folder

from pagedkv import cpu_memory, native
from pagedkv.attention import kernel, paged


@dataclass(slots=True)
class Layer:
    k: torch.Tensor
    v: torch.Tensor


@dataclass(slots=True)
class Batch:
    q: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    layers: list[Layer]
    scale: float
    meta: paged.AttentionMetadata  # the same decode step as the engine describes it


def add_batch_args(p: argparse.ArgumentParser) -> None:
    """The decode batch make_batch draws: how many requests, and their contexts."""
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--min-ctx", type=int, default=100)
    p.add_argument("--max-ctx", type=int, default=900)


def make_batch(args: argparse.Namespace, dtype: torch.dtype, gen: torch.Generator) -> Batch:
    """Requests with their blocks drawn at random from a pool with 25% to spare."""
    seq_lens = torch.randint(
        args.min_ctx, args.max_ctx + 1, (args.requests,), generator=gen, dtype=torch.int32
    )
    blocks_each = (seq_lens + args.block_size - 1) // args.block_size
    max_blocks = int(blocks_each.max())
    num_blocks = int(int(blocks_each.sum()) * 1.25) + 1
    pool = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    block_tables = torch.zeros(args.requests, max_blocks, dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks_each.tolist()):
        block_tables[b, :n] = pool[used : used + n]
        used += n
    shape = (num_blocks, args.kv_heads, args.block_size, args.head_dim)
    # on 2 MiB pages where the OS gives them, as the engine's pool (pagedkv/cpu_memory.py)
    layers = [
        Layer(
            *(
                cpu_memory.empty(*shape, dtype=dtype).copy_(torch.randn(shape, generator=gen))
                for _ in "kv"
            )
        )
        for _ in range(args.layers)
    ]
    q = torch.randn(args.requests, args.q_heads, args.head_dim, generator=gen).to(dtype)
    meta = paged.AttentionMetadata(
        slot_mapping=torch.zeros(args.requests, dtype=torch.int64),  # unused: nothing is stored
        query_start_loc=torch.arange(args.requests + 1, dtype=torch.int32),
        seq_lens=seq_lens,
        block_tables=block_tables,
        query_lens=[1] * args.requests,
        seq_lens_list=seq_lens.tolist(),
        block_size=args.block_size,
        is_decode=True,
    )
    return Batch(q, seq_lens, block_tables, layers, args.head_dim**-0.5, meta)


def gather_sdpa(batch: Batch, layer: Layer) -> torch.Tensor:
    """Gather every request's blocks into a padded batch, then one masked SDPA call (GQA)."""
    _, kv_heads, block_size, head_dim = layer.k.shape
    tables = batch.block_tables.long()

    def gather(cache: torch.Tensor) -> torch.Tensor:
        return cache[tables].permute(0, 2, 1, 3, 4).reshape(tables.shape[0], kv_heads, -1, head_dim)

    k, v = gather(layer.k), gather(layer.v)
    mask = (torch.arange(k.shape[2]) < batch.seq_lens.unsqueeze(1))[:, None, None, :]
    out = F.scaled_dot_product_attention(
        batch.q.unsqueeze(2), k, v, attn_mask=mask, scale=batch.scale, enable_gqa=True
    )
    return out.squeeze(2)


def torch_path(batch: Batch, layer: Layer) -> torch.Tensor:
    """The engine's torch path (paged.torch_attention): one padded gather into reused buffers,
    then masked matmuls."""
    return paged.torch_attention(batch.q, layer.k, layer.v, batch.meta, batch.scale)


def paged_kernel(batch: Batch, layer: Layer) -> torch.Tensor:
    return kernel.paged_attention_decode(
        batch.q, layer.k, layer.v, batch.seq_lens, batch.block_tables, batch.scale
    )


def resident_kernel(batch: Batch, layer: Layer) -> torch.Tensor:
    """The kernel with every table entry pointing at one of two blocks: the same arithmetic on
    K/V that stay in L1/L2, so its time is the kernel's work without the memory's."""
    return kernel.paged_attention_decode(
        batch.q, layer.k, layer.v, batch.seq_lens, batch.block_tables % 2, batch.scale
    )


def load_reader(folder: str) -> ctypes.CDLL:
    """benchmarks/read_runs.cpp, compiled for this CPU as the kernels are (its threads torch's)."""
    from torch.utils import cpp_extension

    source = Path(__file__).with_name("read_runs.cpp")
    cpp_extension.load(
        name="read_runs",
        sources=[str(source)],
        extra_cflags=["-O2", "-march=native", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        build_directory=folder,
        is_python_module=False,
    )
    reader = ctypes.CDLL(str(Path(folder) / "read_runs.so"))
    reader.pk_read_runs.restype = ctypes.c_float
    return reader


READER: ctypes.CDLL | None = None  # set by main


def read_runs(batch: Batch, layer: Layer) -> torch.Tensor:
    """The kernel's K/V lines in its order, summed: its access pattern without its arithmetic."""
    assert READER is not None
    _, heads, block_size, dim = layer.k.shape
    tables = batch.block_tables
    nblocks = ((batch.seq_lens + block_size - 1) // block_size).to(torch.int32)
    total = READER.pk_read_runs(
        ctypes.c_void_p(layer.k.data_ptr()),
        ctypes.c_void_p(layer.v.data_ptr()),
        ctypes.c_void_p(tables.data_ptr()),
        tables.shape[1],
        ctypes.c_void_p(nblocks.data_ptr()),
        tables.shape[0],
        heads,
        ctypes.c_int64(block_size * dim * layer.k.element_size()),
    )
    return torch.tensor(total)


WAYS: dict[str, Callable[[Batch, Layer], torch.Tensor]] = {
    "kernel": paged_kernel,
    "runs": read_runs,
    "torch": torch_path,
    "gather": gather_sdpa,
    "resident": resident_kernel,
}


@dataclass(slots=True)
class Timings:
    best: dict[str, float]  # ms per layer, best round, by way
    read: float  # bytes per second of the plain read, best round
    paired: list[tuple[float, float]]  # each round's kernel ms and the read (bytes/s) right after


def time_per_layer(
    batch: Batch, rounds: int, probe: torch.Tensor, clock: Callable[[], float] = time.perf_counter
) -> Timings:
    """Milliseconds per layer of each way over `rounds` passes through all layers, and the bytes
    per second of a plain read (`probe.sum()`, a buffer much larger than the caches). The ways
    and the read take turns within each round, so that load from elsewhere on the machine hits
    the kernel and its bound alike (a bound measured once, before, moved 30% between runs)."""
    best = dict.fromkeys(WAYS, float("inf"))
    probe_bytes = probe.numel() * probe.element_size()
    read = 0.0
    paired = []
    for fn in WAYS.values():
        fn(batch, batch.layers[0])
    probe.sum()
    for _ in range(rounds):
        for name, fn in WAYS.items():
            start = clock()
            for layer in batch.layers:
                fn(batch, layer)
            ms = (clock() - start) * 1e3 / len(batch.layers)
            best[name] = min(best[name], ms)
            start = clock()
            probe.sum()
            rate = probe_bytes / (clock() - start)
            read = max(read, rate)
            if name == "kernel":
                paired.append((ms, rate))
    return Timings(best, read, paired)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_batch_args(p)
    add_attention_args(p, rounds=5, dtypes="float32,bfloat16")
    p.add_argument(
        "--bandwidth", type=float, help="GB/s for the memory bound (default: measured here)"
    )
    args, clock = parse_timed(p)

    start = time.perf_counter()
    assert kernel.available(), "the C++ kernel did not build; see the warning above"
    print(
        f"kernel ready in {time.perf_counter() - start:.1f} s "
        f"(compiled now: {native.build_seconds is not None}), ISA={native.selected_isa()}, "
        f"threads={torch.get_num_threads()}"
        f"{', timed by CPU time' if args.cpu_time else ''}"
    )
    # 1 GiB to read, on the same kind of pages as the caches
    probe = cpu_memory.empty(2**30 // 4, dtype=torch.float32).fill_(1.0)
    print(
        "memory bound: "
        + (
            f"{args.bandwidth:.1f} GB/s (given)"
            if args.bandwidth
            else "a sum over 1 GiB, timed between the ways"
        )
    )
    global READER
    folder = tempfile.TemporaryDirectory()
    READER = load_reader(folder.name)
    print(
        "| dtype | read (GB/s) | K/V read (MiB) | memory bound (ms) | kernel (ms) | kernel / bound "
        "| kernel / bound, each round: median (range) | runs read alone (ms) | K/V in cache (ms) "
        "| torch path (ms) | gather + SDPA (ms) | torch / kernel | gather / kernel |"
    )
    print("|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        batch = make_batch(args, dtype, torch.Generator().manual_seed(args.seed))
        layer = batch.layers[0]
        torch.testing.assert_close(
            paged_kernel(batch, layer).float(),
            torch_path(batch, layer).float(),
            atol=2e-2,
            rtol=2e-2,
        )
        elem = layer.k.element_size()
        kv_bytes = int(batch.seq_lens.sum()) * args.kv_heads * args.head_dim * 2 * elem
        timed = time_per_layer(batch, args.rounds, probe, clock)
        ms = timed.best
        bandwidth = args.bandwidth * 1e9 if args.bandwidth else timed.read
        bound = kv_bytes / bandwidth * 1e3
        # each round's kernel against the read timed right after it (or the given rate)
        ratios = [
            kernel_ms / (kv_bytes / (args.bandwidth * 1e9 if args.bandwidth else rate) * 1e3)
            for kernel_ms, rate in timed.paired
        ]
        fast, slow, gather = ms["kernel"], ms["torch"], ms["gather"]
        print(
            f"| {name} | {bandwidth / 1e9:.1f} | {kv_bytes / 2**20:.1f} | {bound:.2f} | {fast:.2f} "
            f"| {fast / bound:.2f} | {statistics.median(ratios):.2f} "
            f"({min(ratios):.2f}-{max(ratios):.2f}) | {ms['runs']:.2f} | {ms['resident']:.2f} "
            f"| {slow:.1f} | {gather:.1f} | {slow / fast:.0f}x | {gather / fast:.0f}x |"
        )


if __name__ == "__main__":
    main()

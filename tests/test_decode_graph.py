"""Decode graphs (model/decode_graph.py): replayed steps give the eager steps' results bit for bit,
for every batch size, block-table width, cascade plan and speculative verify a run goes through; a
forward that torch computes in runs eagerly; a kernel failing inside a replay says which call."""

from __future__ import annotations

import ctypes

import pytest
import torch

from pagedkv import LLM, SamplingParams, native
from pagedkv.model import decode_graph, prepacked

needs_library = pytest.mark.skipif(not native.available(), reason="the C++ library is not built")


def replays(dtype: str) -> bool:
    """Whether this build multiplies the model's matmuls with GEMMs of ours: bfloat16 needs
    AVX512_BF16, float32 an AVX-512 or AVX2 build (not NEON nor portable). Where torch's (oneDNN,
    MKL) run, every step is eager."""
    if dtype == "bfloat16":
        return prepacked.form() == "pairs"
    return prepacked.float32_form() == "panels"


PROMPT = "Memory is cut into fixed-size blocks handed out on demand, mapped by a block table. "


def _generate(model: str, monkeypatch, eager: bool, **options):
    """Outputs (tokens and top-3 logprobs of every sample) of a batch whose size changes as its
    requests finish, sharing a prefix, and the replays and recordings the run made."""
    counts = {"replays": 0, "records": 0}
    run, record = native.KernelGraph.run, decode_graph.DecodeGraphs._record

    def counting_run(self):
        counts["replays"] += 1
        return run(self)

    def counting_record(self, *args):
        counts["records"] += 1
        return record(self, *args)

    monkeypatch.setattr(native.KernelGraph, "run", counting_run)
    monkeypatch.setattr(decode_graph.DecodeGraphs, "_record", counting_record)
    llm = LLM(model, block_size=4, num_gpu_blocks_override=512, enforce_eager=eager, **options)
    prompts = [PROMPT * 2 + "Hello", PROMPT * 2 + "The quick", "Paged attention", PROMPT * 2]
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=3)
        for n in (40, 23, 9, 31)
    ] + [SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=17, ignore_eos=True)]
    outs = llm.generate([*prompts, prompts[0]], params, use_tqdm=False)
    result = [
        [(c.token_ids, [sorted(lp.items()) for lp in c.logprobs or []]) for c in o.outputs]
        for o in outs
    ]
    return result, counts, llm.engine.runner.graphs


@needs_library
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("cascade", ["0", "1"])
def test_replayed_steps_equal_eager_ones(tiny_model_dir, monkeypatch, dtype, cascade) -> None:
    monkeypatch.setenv("PAGEDKV_CASCADE", cascade)
    eager, counts, graphs = _generate(tiny_model_dir, monkeypatch, True, dtype=dtype)
    assert graphs is None and counts == {"replays": 0, "records": 0}
    replayed, counts, graphs = _generate(tiny_model_dir, monkeypatch, False, dtype=dtype)
    assert replayed == eager
    if not replays(dtype):  # the matmuls run on oneDNN, MKL or torch here: every step is eager
        assert counts["replays"] == 0 and graphs.eager and not graphs.graphs
        return
    # batch sizes 7 down to 1 as requests finish; block tables grow past 4, 8 and 16 blocks
    assert counts["replays"] >= 30 and counts["records"] >= 5
    assert not graphs.eager and len({key[1] for key in graphs.graphs}) >= 4
    assert any(key[2] for key in graphs.graphs) == (
        cascade == "1"
    )  # steps with a plan, and without
    assert any(
        key[0] > key[1] for key in graphs.graphs
    )  # verify steps of n-gram drafts (the prompts repeat)
    assert len({g.buffers.h.data_ptr() for g in graphs.graphs.values()}) == 1  # one shared arena
    widths = {g.block_tables.shape[1] for g in graphs.graphs.values()}
    assert all(w & (w - 1) == 0 for w in widths) and max(widths) >= 16


@needs_library
@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "smollm3", "granite", "gemma2", "gemma3"])
def test_other_families_steps_replay(arch, tmp_path, monkeypatch) -> None:
    """Qwen2's bias and Qwen3's q/k norms run inside the RoPE kernel, Gemma's GELU in the
    activation's and its extra norms in the norm's, Gemma 2's soft-capped scores in the
    attention's, SmolLM3's layers without RoPE as a RoPE call without tables, Granite's residual
    multiplier in the norm's add: their steps replay too."""
    from tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / arch, arch=arch)
    eager, _, _ = _generate(model, monkeypatch, True, dtype="float32")
    got, counts, graphs = _generate(model, monkeypatch, False, dtype="float32")
    assert got == eager
    if replays("float32"):
        assert counts["replays"] >= 10 and not graphs.eager
    assert_greedy_equals_transformers(model, eager)


@needs_library
@pytest.mark.parametrize("window", [24, 60])
def test_sliding_window_steps_replay_and_equal_transformers(window, tmp_path, monkeypatch) -> None:
    """A Mistral-style window: prompts longer than it, and (60) sequences sharing a prefix that
    start inside it with a cascade plan and grow past it, where the plan must give way. Replays
    equal eager steps, and greedy outputs equal transformers'."""
    import json

    from tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "mistral")
    cfg = json.loads((tmp_path / "mistral" / "config.json").read_text())
    cfg.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=window)
    (tmp_path / "mistral" / "config.json").write_text(json.dumps(cfg))
    monkeypatch.setenv("PAGEDKV_CASCADE", "1")
    eager, _, _ = _generate(model, monkeypatch, True, dtype="float32")
    got, counts, graphs = _generate(model, monkeypatch, False, dtype="float32")
    assert got == eager
    if replays("float32"):
        assert counts["replays"] >= 10 and not graphs.eager
        assert any(key[2] for key in graphs.graphs) == (window == 60)
        assert any(not key[2] for key in graphs.graphs)
    assert_greedy_equals_transformers(model, eager)


def assert_greedy_equals_transformers(model: str, outputs) -> None:
    """_generate's greedy outputs of a long and a short prompt are transformers' own."""
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    tok = LLM(model).get_tokenizer()
    for prompt, out in zip([PROMPT * 2 + "Hello", "Paged attention"], [outputs[0], outputs[2]]):
        ids, tokens = tok.encode(prompt), list(out[0][0])
        n = len(tokens)
        with torch.inference_mode():
            want = hf.generate(
                torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False
            )
        assert tokens == want[0, len(ids) :].tolist()


@needs_library
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_quantized_cache_steps_replay(tiny_model_dir, monkeypatch, kv_cache_dtype, dtype) -> None:
    """A quantized cache's rotation runs inside the kernels that write and read it, so its steps
    replay too, equal to eager ones bit for bit."""
    monkeypatch.setenv("PAGEDKV_CASCADE", "1")
    options = {"kv_cache_dtype": kv_cache_dtype, "dtype": dtype}
    eager, _, _ = _generate(tiny_model_dir, monkeypatch, True, **options)
    got, counts, graphs = _generate(tiny_model_dir, monkeypatch, False, **options)
    assert got == eager
    if not replays(dtype):
        return  # matmuls on oneDNN, MKL or torch: eager (test_replayed_steps_equal_eager_ones)
    assert counts["replays"] >= 30 and not graphs.eager and any(key[2] for key in graphs.graphs)


@needs_library
def test_a_forward_torch_computes_in_runs_eagerly(tiny_model_dir, monkeypatch) -> None:
    """int8 weights multiply on torch's kernel at a step's few rows: such a step is not
    replayable, runs eagerly, the same. (From a row count up they multiply a dense copy on our
    GEMM, where one exists for this CPU: those steps may replay.)"""
    eager, _, _ = _generate(tiny_model_dir, monkeypatch, True, quantization="int8")
    got, _, graphs = _generate(tiny_model_dir, monkeypatch, False, quantization="int8")
    assert got == eager
    assert (1, 1, False, torch.get_num_threads(), 0) in graphs.eager
    assert not set(graphs.eager) & set(graphs.graphs)


@needs_library
def test_views_are_allowed_and_computing_is_not() -> None:
    x = torch.arange(12.0)
    with decode_graph._ViewsOnly():
        y = x.view(3, 4)[:, 1:].t().reshape(3, 3)
        with pytest.raises(decode_graph.NotReplayable, match="aten.add"):
            x + 1
        with pytest.raises(decode_graph.NotReplayable, match="aten.empty"):
            torch.empty(2)
    assert y.data_ptr() == x.data_ptr() + x.element_size()  # (a view of x from x[1])


@needs_library
def test_a_kernel_failing_in_a_replay_says_which_call() -> None:
    lib = native.library()
    assert lib is not None
    x = torch.tensor([[1.0, 3.0, 2.0]])
    out = torch.zeros(1, dtype=torch.int64)
    fields = dict(x=x.data_ptr(), x_stride=3, out=out.data_ptr(), rows=1, n=3, threads=1)
    with lib.record() as calls:
        lib.call("argmax", **fields)
        lib.call("argmax", **fields)
        with pytest.raises(RuntimeError, match="already under way"):
            with lib.record():
                pass
    assert [k for k, _ in calls] == ["argmax", "argmax"] and out.item() == 1
    graph = lib.graph(calls)
    x[0, 2], out[0] = 5.0, -1
    graph.run()  # the recorded structs point at x and out: the replay reads x anew
    assert out.item() == 2
    graph.structs("argmax")[1].n = 0
    with pytest.raises(native.KernelError, match=r"run_graph: call 1 of 2: need rows >= 0, 1 <= n"):
        graph.run()
    assert isinstance(graph.structs("argmax")[0], ctypes.Structure)

"""LoRA adapters: greedy output under an adapter equals transformers with the adapter merged into
the weights (W + s * B @ A), alone and batched with base-model requests; adapters keep their
prefix-cache blocks apart; a server names them as models.

The adapters are PEFT folders written here with random A and B (PEFT starts B at zero, which would
change nothing).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from server_process import TINY_SERVER, ServerProcess, serve_error

from pagedkv import LLM, LoRARequest, SamplingParams
from pagedkv.config import ConfigError

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPTS = [[5, 9, 23, 7, 81, 3], [40, 2, 2, 19], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def make_adapter(
    folder: Path, model_dir: str, *, rank: int = 4, alpha: float = 8.0, seed: int = 0,
    modules: tuple[str, ...] = MODULES, **config,
) -> str:  # fmt: skip
    """A PEFT folder for the tiny model."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    shapes = {  # (in, out)
        "q_proj": (cfg.hidden_size, cfg.num_attention_heads * head_dim),
        "k_proj": (cfg.hidden_size, cfg.num_key_value_heads * head_dim),
        "v_proj": (cfg.hidden_size, cfg.num_key_value_heads * head_dim),
        "o_proj": (cfg.num_attention_heads * head_dim, cfg.hidden_size),
        "gate_proj": (cfg.hidden_size, cfg.intermediate_size),
        "up_proj": (cfg.hidden_size, cfg.intermediate_size),
        "down_proj": (cfg.intermediate_size, cfg.hidden_size),
        # Phi-3's, fused as its checkpoint holds them
        "qkv_proj": (
            cfg.hidden_size,
            (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * head_dim,
        ),
        "gate_up_proj": (cfg.hidden_size, 2 * cfg.intermediate_size),
    }
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for m in modules:
            where = (
                "mlp" if m in ("gate_proj", "up_proj", "down_proj", "gate_up_proj") else "self_attn"
            )
            stem = f"base_model.model.model.layers.{layer}.{where}.{m}"
            fan_in, fan_out = shapes[m]
            tensors[f"{stem}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.2
            tensors[f"{stem}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.2
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    peft = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "bias": "none",
            "target_modules": list(modules), **config}  # fmt: skip
    (folder / "adapter_config.json").write_text(json.dumps(peft))
    return str(folder)


def merged_greedy(
    model_dir: str, adapter: str | None, prompts: list[list[int]], max_tokens: int = 8
) -> list[list[int]]:
    """transformers, float32, with the adapter merged into the weights."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    if adapter is not None:
        cfg = json.loads((Path(adapter) / "adapter_config.json").read_text())
        scale = cfg["lora_alpha"] / cfg["r"]
        weights = load_file(str(Path(adapter) / "adapter_model.safetensors"))
        params = dict(model.named_parameters())
        with torch.no_grad():
            for key, a in weights.items():
                if key.endswith("lora_A.weight"):
                    stem = key.removesuffix(".lora_A.weight").removeprefix("base_model.model.")
                    b = weights[key.replace("lora_A", "lora_B")]
                    params[f"{stem}.weight"] += scale * b @ a
    out = []
    for p in prompts:
        ids = model.generate(
            torch.tensor([p]),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        out.append(ids[0, len(p) :].tolist())
    return out


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora")
    return {
        "all": make_adapter(root / "all", tiny_model_dir, seed=1),
        "attn": make_adapter(root / "attn", tiny_model_dir, seed=2, rank=2,
                             modules=("q_proj", "v_proj"), use_rslora=True, lora_alpha=4.0),
    }  # fmt: skip


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    engine = LLM(tiny_model_dir, dtype="float32", enable_lora=True, num_gpu_blocks_override=256)
    yield engine
    engine.close()


def greedy(llm, prompts, lora=None) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, False, lora_request=lora)]


def test_greedy_output_under_an_adapter_equals_the_merged_model(llm, tiny_model_dir, adapters):
    request = LoRARequest("all", 1, adapters["all"])
    expected = merged_greedy(tiny_model_dir, adapters["all"], PROMPTS)
    assert greedy(llm, PROMPTS, request) == expected
    assert expected != merged_greedy(tiny_model_dir, None, PROMPTS)  # the adapter changed them


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_other_families_under_an_adapter_equal_the_merged_model(arch, tmp_path):
    """Qwen3's heads wider than hidden / heads; Gemma 3's norms around the adapted projections,
    GELU, window layers."""
    from tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / arch, arch=arch)
    adapter = make_adapter(tmp_path / "a", model, seed=3)
    llm = LLM(model, dtype="float32", enable_lora=True, num_gpu_blocks_override=128)
    try:
        got = greedy(llm, PROMPTS, LoRARequest("a", 1, adapter))
        assert got == merged_greedy(model, adapter, PROMPTS)
        assert got != greedy(llm, PROMPTS)
    finally:
        llm.close()


def test_rslora_and_a_subset_of_modules(llm, tiny_model_dir, adapters):
    """rsLoRA scales by alpha / sqrt(r); the oracle scales by alpha / r, so it gets an alpha that
    gives the same scale."""
    cfg_path = Path(adapters["attn"]) / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    oracle = Path(adapters["attn"]).parent / "attn-plain"
    oracle.mkdir(exist_ok=True)
    (oracle / "adapter_model.safetensors").write_bytes(
        (Path(adapters["attn"]) / "adapter_model.safetensors").read_bytes()
    )
    plain = {**cfg, "use_rslora": False, "lora_alpha": cfg["lora_alpha"] * cfg["r"] ** 0.5}
    (oracle / "adapter_config.json").write_text(json.dumps(plain))
    got = greedy(llm, PROMPTS, LoRARequest("attn", 2, adapters["attn"]))
    assert got == merged_greedy(tiny_model_dir, str(oracle), PROMPTS)


def test_a_batch_mixing_adapters_and_the_base_model_gives_each_its_own_output(llm, adapters):
    a, b = LoRARequest("all", 1, adapters["all"]), LoRARequest("attn", 2, adapters["attn"])
    alone = {
        None: greedy(llm, PROMPTS),
        "all": greedy(llm, PROMPTS, a),
        "attn": greedy(llm, PROMPTS, b),
    }
    mixed = [a, None, b, b, None, a, None, a, b]
    prompts = [PROMPTS[i % 3] for i in range(9)]
    outs = greedy(llm, prompts, mixed)
    for i, (lora, out) in enumerate(zip(mixed, outs)):
        assert out == alone[lora.lora_name if lora else None][i % 3], i
    llm.engine.kv.check_integrity()


def test_decode_steps_under_adapters_replay_their_recorded_calls(llm, tiny_model_dir, adapters):
    """A step with adapters is recorded once (its rows' adapters an input of the replay) and
    replayed after, with the output of an engine that runs every step eagerly."""
    from pagedkv.model import prepacked

    loras = [LoRARequest("all", 1, adapters["all"]), None, LoRARequest("attn", 2, adapters["attn"])]
    graphs = llm.engine.runner.graphs
    outs = greedy(llm, PROMPTS, loras)
    recorded = [key for key in graphs.graphs if key[4]]  # keyed by the adapters' tables
    if prepacked.float32_form() == "panels":  # float32 matmuls of ours: the steps replay
        assert recorded and not any(key[4] for key in graphs.eager)
    else:  # (NEON and portable builds: MKL multiplies, every step is eager)
        assert not recorded
    eager = LLM(tiny_model_dir, dtype="float32", enable_lora=True, enforce_eager=True)
    assert outs == [o.outputs[0].token_ids for o in eager.generate(PROMPTS, GREEDY, False,
                                                                   lora_request=loras)]  # fmt: skip
    eager.close()


def test_accepted_speculative_drafts_never_change_an_adapters_output(llm, tiny_model_dir, adapters):
    """Prompts that repeat a motif give n-gram drafts; each sequence's drafts are rows of its
    adapter's span of the step, verified under it: the output is still the merged model's."""
    prompts = [[7, 19, 4] * 5, [300, 12] * 6 + [9], [41, 42, 43, 44] * 4]
    lora = LoRARequest("all", 1, adapters["all"])
    stats = llm.engine.spec_stats
    accepted = stats.num_accepted_tokens
    long = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, long, False, lora_request=lora)]
    assert stats.num_accepted_tokens > accepted  # some drafts were accepted
    assert got == merged_greedy(tiny_model_dir, adapters["all"], prompts, max_tokens=24)


def test_preemption_and_chunked_prefill_never_change_an_adapters_output(
    llm, tiny_model_dir, adapters
):
    """12 blocks of 4 tokens hold one request's 26 tokens, not four; prompts go in 7-token
    chunks: each sequence's rows under its adapter, whatever the step holds of it."""
    loras = [LoRARequest("all", 1, adapters["all"]), None, LoRARequest("attn", 2, adapters["attn"])]
    prompts = [*PROMPTS, PROMPTS[0]]
    mixed = [*loras, loras[0]]
    long = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    expected = [
        o.outputs[0].token_ids for o in llm.generate(prompts, long, False, lora_request=mixed)
    ]
    small = LLM(tiny_model_dir, dtype="float32", enable_lora=True, num_gpu_blocks_override=12,
                block_size=4, max_num_batched_tokens=7)  # fmt: skip
    outs = small.generate(prompts, long, False, lora_request=mixed)
    assert small.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == expected
    small.engine.kv.check_integrity()
    small.close()


PHI3_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def test_an_adapter_of_phi_3s_fused_projections_equals_the_merged_model(tmp_path):
    """Phi-3's adapters name its fused qkv_proj and gate_up_proj: B's rows span q, k and v (gate
    and up), cut into each part's rows beside the one A; as merged by transformers, at -tp 1 and
    -tp 2 (each rank cuts them as its weights)."""
    from tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "phi3", arch="phi3", heads=4, kv_heads=2)
    adapter = make_adapter(tmp_path / "a", model, seed=4, modules=PHI3_MODULES)
    want = merged_greedy(model, adapter, PROMPTS)
    assert want != merged_greedy(model, None, PROMPTS)
    for tp in (1, 2):
        llm = LLM(model, dtype="float32", enable_lora=True, tensor_parallel_size=tp,
                  num_gpu_blocks_override=128)  # fmt: skip
        try:
            assert greedy(llm, PROMPTS, LoRARequest("a", 1, adapter)) == want
        finally:
            llm.close()


def test_tensor_parallel_ranks_each_apply_their_share_of_every_adapter(
    llm, tiny_model_dir, adapters
):
    """-tp 2: each rank cuts every adapter where its weights are cut (B's columns of q/k/v/gate/up,
    A's features of o/down, whose partial sums the all-reduce adds): the output of -tp 1 for a
    batch mixing adapters and the base model, also after an adapter is unloaded and loaded again
    (the other ranks follow rank 0's slots)."""
    a, b = LoRARequest("all", 1, adapters["all"]), LoRARequest("attn", 2, adapters["attn"])
    mixed = [a, None, b, b, None, a]
    prompts = [PROMPTS[i % 3] for i in range(6)]
    want = greedy(llm, prompts, mixed)
    tp = LLM(tiny_model_dir, dtype="float32", enable_lora=True, tensor_parallel_size=2,
             num_gpu_blocks_override=256)  # fmt: skip
    try:
        assert greedy(tp, prompts, mixed) == want
        tp.engine.remove_lora("all")
        assert greedy(tp, prompts[2:4], [b, b]) == want[2:4]
        assert greedy(tp, prompts, mixed) == want  # "all" now after "attn": slots 1 and 0
        assert list(tp.engine.loras) == ["attn", "all"]
        tp.engine.kv.check_integrity()
    finally:
        tp.close()


def test_adapters_never_share_prefix_blocks_with_the_base_or_each_other(llm, adapters):
    prompt = list(range(100, 180))  # 80 tokens: whole blocks to cache
    params = SamplingParams(temperature=0, max_tokens=1)
    a = LoRARequest("all", 1, adapters["all"])

    def cached(lora) -> int:
        (out,) = llm.generate([prompt], params, False, lora_request=lora)
        return out.num_cached_tokens

    cached(None)  # the base model's blocks
    assert cached(a) == 0  # not the adapter's
    assert cached(a) >= 64 and cached(None) >= 64  # each finds its own


def test_the_async_engine_takes_a_lora_request(tiny_model_dir, adapters, llm):
    import asyncio

    from pagedkv import AsyncEngineArgs, AsyncLLMEngine

    request = LoRARequest("all", 1, adapters["all"])
    want = greedy(llm, PROMPTS[:1], request)[0]

    async def main() -> list[int]:
        args = AsyncEngineArgs(model=tiny_model_dir, dtype="float32", enable_lora=True)
        engine = AsyncLLMEngine.from_engine_args(args)
        async for out in engine.generate(PROMPTS[0], GREEDY, "r1", lora_request=request):
            last = out
        await engine.shutdown()
        return last.outputs[0].token_ids

    assert asyncio.run(main()) == want


def test_a_disk_tier_never_hands_an_adapters_blocks_to_other_weights_under_its_name(
    tiny_model_dir, tmp_path
):
    """The blocks are keyed by the adapter's files, not its name alone: a restart with the same
    name and folder but new weights finds none of them; with the same weights, all."""
    folder, tier = tmp_path / "x", str(tmp_path / "tier")
    prompt = list(range(100, 180))
    one = SamplingParams(temperature=0, max_tokens=1)

    def cached(seed: int) -> int:
        if folder.exists():
            for f in folder.iterdir():
                f.unlink()
            folder.rmdir()
        make_adapter(folder, tiny_model_dir, seed=seed)
        llm = LLM(tiny_model_dir, dtype="float32", enable_lora=True, kv_offload_dir=tier)
        (out,) = llm.generate([prompt], one, False, lora_request=LoRARequest("x", 1, str(folder)))
        llm.close()
        return out.num_cached_tokens

    assert cached(seed=1) == 0
    assert cached(seed=1) >= 64  # the same weights: the tier's blocks
    assert cached(seed=2) == 0  # new weights under the same name: none


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_the_lora_kernel_equals_its_torch_path(dtype, rows, kernel_isa, monkeypatch):
    """Two parts of a fused projection, three adapters (one without the first part, one of rank
    0 nowhere), rows under each and under none, x and out rows of wider tensors: the kernel's
    result is the torch path's, and that is the float64 formula."""
    from pagedkv import native
    from pagedkv.model.lora import Delta, LoRABatch, LoRATables, PartTable

    gen = torch.Generator().manual_seed(rows)

    def delta(rank: int, width: int) -> Delta:
        a, b = torch.randn(rank, 40, generator=gen), torch.randn(rank, width, generator=gen)
        return Delta(a.to(dtype), b.to(dtype))

    d0, d1, d2 = delta(3, 24), delta(5, 20), delta(16, 20)
    parts = [PartTable.of(0, 24, [d0, None, None]), PartTable.of(30, 20, [None, d1, d2])]
    tables = LoRATables(adapters=[], layers=[{"qkv": parts}])
    slots = torch.tensor([(r * 7) % 4 - 1 for r in range(rows)], dtype=torch.int32)  # -1 .. 2
    batch = LoRABatch(tables, slots)
    x = torch.randn(rows, 45, generator=gen).to(dtype)[:, 2:42]
    out = torch.randn(rows, 56, generator=gen).to(dtype)[:, :52]
    before = out.clone()

    got = out.clone()
    batch.add(0, "qkv", x, got)
    want = out.clone()
    with monkeypatch.context() as m:
        m.setattr(native, "library_for", lambda *tensors: None)
        batch.add(0, "qkv", x, want)
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-3}[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * 8)

    exact = before.double()
    for r, s in enumerate(slots.tolist()):
        for part in parts:
            d = part.deltas[s] if s >= 0 else None
            if d is not None:
                cols = slice(part.cols, part.cols + part.width)
                exact[r, cols] += (x[r].double() @ d.a.double().T) @ d.b.double()
    torch.testing.assert_close(want.double(), exact.to(dtype).double(), rtol=tol, atol=tol * 8)
    untouched = slots == -1
    assert torch.equal(got[untouched], before[untouched])
    assert torch.equal(got[:, 24:30], before[:, 24:30])  # columns no part covers
    if rows > 1:
        assert not torch.equal(got, before)


def test_adapter_mistakes_are_config_errors(llm, tiny_model_dir, adapters, tmp_path):
    greedy(llm, PROMPTS[:1], LoRARequest("all", 1, adapters["all"]))
    with pytest.raises(ConfigError, match="already loaded from"):
        llm.generate([PROMPTS[0]], GREEDY, False, lora_request=LoRARequest("all", 9, "/x"))
    big = make_adapter(tmp_path / "big", tiny_model_dir, rank=32)
    with pytest.raises(ConfigError, match="rank 32 exceeds --max-lora-rank 16"):
        llm.generate([PROMPTS[0]], GREEDY, False, lora_request=LoRARequest("big", 3, big))
    dora = make_adapter(tmp_path / "dora", tiny_model_dir, use_dora=True)
    with pytest.raises(ConfigError, match="use_dora=True is not supported"):
        llm.generate([PROMPTS[0]], GREEDY, False, lora_request=LoRARequest("dora", 4, dora))
    with pytest.raises(ConfigError, match="no readable adapter_config.json"):
        llm.generate([PROMPTS[0]], GREEDY, False, lora_request=LoRARequest("x", 5, str(tmp_path)))
    from tiny_model import make_tiny_model

    other = make_adapter(tmp_path / "other", make_tiny_model(tmp_path / "m32", hidden=32))
    with pytest.raises(ConfigError, match="do not fit the model"):
        llm.generate([PROMPTS[0]], GREEDY, False, lora_request=LoRARequest("o", 6, other))
    # a vision tower's module of the very shape of a text layer's is not taken for one
    from safetensors.torch import load_file, save_file

    vision = Path(make_adapter(tmp_path / "vision", tiny_model_dir))
    tensors = load_file(vision / "adapter_model.safetensors")
    stem = "base_model.model.vision_tower.vision_model.encoder.layers.0.self_attn.q_proj"
    for kind in ("A", "B"):
        text = tensors[f"base_model.model.model.layers.0.self_attn.q_proj.lora_{kind}.weight"]
        tensors[f"{stem}.lora_{kind}.weight"] = text.clone()
    save_file(tensors, vision / "adapter_model.safetensors")
    with pytest.raises(ConfigError, match="unsupported module 'base_model.model.vision_tower"):
        llm.generate([PROMPTS[0]], GREEDY, False, lora_request=LoRARequest("v", 8, str(vision)))
    # a fused projection's B must span its parts, and a part is given once
    both = make_adapter(tmp_path / "both", tiny_model_dir, modules=("q_proj", "qkv_proj"))
    with pytest.raises(ConfigError, match="layer 0 qkv: a part given twice"):
        llm.generate([PROMPTS[0]], GREEDY, False, lora_request=LoRARequest("b", 10, both))
    cut = Path(make_adapter(tmp_path / "cut", tiny_model_dir, modules=("qkv_proj",)))
    tensors = load_file(cut / "adapter_model.safetensors")
    key = "base_model.model.model.layers.1.self_attn.qkv_proj.lora_B.weight"
    tensors[key] = tensors[key][:-16]
    save_file(tensors, cut / "adapter_model.safetensors")
    with pytest.raises(ConfigError, match="qkv_proj': B has 112 rows, the projection 128"):
        llm.generate([PROMPTS[0]], GREEDY, False, lora_request=LoRARequest("c", 11, str(cut)))
    with pytest.raises(ConfigError, match="that is the base model's name"):
        llm.generate(
            [PROMPTS[0]], GREEDY, False, lora_request=LoRARequest(llm.engine.model_name, 7, "/x")
        )
    with pytest.raises(ConfigError, match="needs --enable-lora"):
        LLM(tiny_model_dir, lora_modules=[f"all={adapters['all']}"])
    from pagedkv.config import EngineConfig

    for item, message in [
        ('{"name": "a", "path": "/p", "base": "m"}', "unknown key 'base'"),
        ('{"name": "a", "path": "/p", "base_model_name": 3}', "are strings"),
        ('{"name": "a"}', "are strings"),
    ]:
        with pytest.raises(ConfigError, match=message):
            EngineConfig(model=tiny_model_dir, enable_lora=True, lora_modules=[item])
    assert not llm.engine.has_unfinished()


sagemaker_name = "X-Amzn-SageMaker-Adapter-Identifier"


def test_a_server_serves_each_adapter_as_a_model(tiny_model_dir, adapters, llm):
    expected = greedy(llm, PROMPTS[:1], LoRARequest("all", 1, adapters["all"]))[0]
    module = json.dumps({"name": "attn", "path": adapters["attn"], "base_model_name": "Tiny/1"})
    with ServerProcess(
        tiny_model_dir, *TINY_SERVER, "--dtype", "float32", "--enable-lora",
        "--lora-modules", f"all={adapters['all']}", module,
    ) as srv:  # fmt: skip
        models = srv.http.get("/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["tiny", "all", "attn"]
        assert models[1]["parent"] == "tiny" and models[1]["root"] == adapters["all"]
        assert models[2]["parent"] == "Tiny/1"  # its base_model_name
        card = srv.http.get("/v1/models/attn").json()  # one card: OpenAI's retrieve
        assert {**card, "created": 0} == {**models[2], "created": 0}
        body = {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        r = srv.http.post("/v1/completions", json={**body, "model": "all"})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "all"
        assert r.json()["choices"][0]["text"] == llm.get_tokenizer().decode(expected)
        r = srv.http.post("/v1/completions", json={**body, "model": "nope"})
        assert r.status_code == 404, r.text
        # SageMaker's /invocations runs on the adapter its header names, over the body's model
        sagemaker = {sagemaker_name: "all"}
        r = srv.http.post("/invocations", json={**body, "model": "tiny"}, headers=sagemaker)
        assert r.status_code == 200 and r.json()["model"] == "all", r.text
        assert r.json()["choices"][0]["text"] == llm.get_tokenizer().decode(expected)
        r = srv.http.post("/invocations", json=body)
        assert r.status_code == 200 and r.json()["model"] == "tiny"
        r = srv.http.post("/invocations", json=body, headers={sagemaker_name: "nope"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text
    line = serve_error("--model", tiny_model_dir, "--lora-modules", "x")[-1]
    assert "--lora-modules takes NAME=PATH or a JSON object" in line


def test_adapters_load_and_unload_at_runtime_where_allowed(
    tiny_model_dir, adapters, llm, monkeypatch
):
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter, and SageMaker's POST /adapters and
    DELETE /adapters/{name}, behind vLLM's environment switch: a loaded adapter serves as a model
    with its offline output, an unloaded one is gone (404), and mistakes are 4xx that change
    nothing."""
    expected = llm.get_tokenizer().decode(
        greedy(llm, PROMPTS[:1], LoRARequest("all", 1, adapters["all"]))[0]
    )
    body = {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    args = (tiny_model_dir, *TINY_SERVER, "--dtype", "float32", "--enable-lora")
    with ServerProcess(*args) as srv:  # without the switch the routes do not exist
        r = srv.http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/"})
        assert r.status_code == 404
        assert srv.http.post("/adapters", json={"name": "x", "src": "/"}).status_code == 404
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    with ServerProcess(*args) as srv:
        load = {"lora_name": "all", "lora_path": adapters["all"]}
        r = srv.http.post("/v1/load_lora_adapter", json=load)
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'all' added successfully."
        assert [m["id"] for m in srv.http.get("/v1/models").json()["data"]] == ["tiny", "all"]
        r = srv.http.post("/v1/completions", json={**body, "model": "all"})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected, r.text
        for bad, status, param in [
            (load, 400, "lora_name"),  # loaded already
            ({"lora_name": "tiny", "lora_path": adapters["all"]}, 400, "lora_name"),
            ({"lora_name": "y", "lora_path": str(Path(adapters["all"]).parent)}, 400, "lora_path"),
            ({"lora_name": "y"}, 400, "lora_path"),
        ]:
            r = srv.http.post("/v1/load_lora_adapter", json=bad)
            assert r.status_code == status and r.json()["error"]["param"] == param, (bad, r.text)
        r = srv.http.post("/v1/unload_lora_adapter", json={"lora_name": "nope"})
        assert r.status_code == 404 and "cannot be found" in r.json()["error"]["message"]
        r = srv.http.post("/v1/unload_lora_adapter", json={"lora_name": "all"})
        assert r.status_code == 200 and "removed successfully" in r.text, r.text
        assert [m["id"] for m in srv.http.get("/v1/models").json()["data"]] == ["tiny"]
        assert srv.http.post("/v1/completions", json={**body, "model": "all"}).status_code == 404
        # loaded again (from its files: its prefix blocks are found again), the same output
        assert srv.http.post("/v1/load_lora_adapter", json=load).status_code == 200
        r = srv.http.post("/v1/completions", json={**body, "model": "all"})
        assert r.json()["choices"][0]["text"] == expected

        # SageMaker's forms: a JSON body or query parameters; answered with the alias if given
        alias = {"X-Amzn-SageMaker-Adapter-Alias": "the SQL one"}
        r = srv.http.post("/adapters", json={"name": "sql", "src": adapters["all"]}, headers=alias)
        assert r.status_code == 200 and r.text == "Adapter the SQL one registered", r.text
        r = srv.http.post("/adapters", params={"name": "q", "src": adapters["all"]})
        assert r.status_code == 200 and r.text == "Adapter q registered", r.text
        for name in ("sql", "q"):
            r = srv.http.post("/v1/completions", json={**body, "model": name})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected, r.text
        for bad, param in [
            ({"name": "q", "src": adapters["all"]}, "name"),  # registered already
            ({"name": "z", "src": str(Path(adapters["all"]).parent)}, "src"),
            ({"name": "", "src": adapters["all"]}, "name"),
            ({"src": adapters["all"]}, "name"),
        ]:
            r = srv.http.post("/adapters", json=bad)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad, r.text)
        r = srv.http.delete("/adapters/q")
        assert r.status_code == 200 and r.text == "Adapter q unregistered", r.text
        r = srv.http.delete("/adapters/q")
        assert r.status_code == 404 and "cannot be found" in r.json()["error"]["message"]
        assert srv.http.post("/v1/completions", json={**body, "model": "q"}).status_code == 404
        served = [m["id"] for m in srv.http.get("/v1/models").json()["data"]]
        assert served == ["tiny", "all", "sql"]
        assert srv.http.get("/health").status_code == 200


def test_an_adapter_in_use_is_not_unloaded(llm, adapters):
    engine = llm.engine
    engine.add_lora("busy", adapters["all"])
    params = SamplingParams(temperature=0, max_tokens=8, lora_name="busy")
    engine.add_request("r1", PROMPTS[0], params)
    engine.step()
    with pytest.raises(ConfigError, match="'busy' is in use by 1 request"):
        engine.remove_lora("busy")
    while engine.has_unfinished():
        engine.step()
    engine.remove_lora("busy")
    assert "busy" not in engine.loras and "busy" not in engine.lora_keys
    with pytest.raises(LookupError):
        engine.remove_lora("busy")
    with pytest.raises(ConfigError, match="no LoRA adapter 'busy'"):
        engine.add_request("r2", PROMPTS[0], params)
    assert not engine.has_unfinished()


def test_generate_runs_a_prompt_under_an_adapter(tiny_model_dir, adapters, llm):
    import subprocess
    import sys

    from server_process import REPO

    expected = llm.generate(["Hello world"], GREEDY, False, lora_request=LoRARequest(
        "all", 1, adapters["all"]))[0].outputs[0].token_ids  # fmt: skip
    cmd = [sys.executable, "-m", "pagedkv.cli", "generate", "--model", tiny_model_dir,
           "--dtype", "float32", "--enable-lora", "--lora-modules", f"all={adapters['all']}",
           "--prompt", "Hello world", "--max-tokens", "8", "--ignore-eos", "--json"]  # fmt: skip
    out = subprocess.run([*cmd, "--lora", "all"], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["output_token_ids"] == expected
    out = subprocess.run([*cmd, "--lora", "nope"], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 2 and "no LoRA adapter 'nope' is loaded" in out.stderr, out.stderr

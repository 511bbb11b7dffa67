"""`pagedkv plan`: KV bytes per token and capacity, checked against hand arithmetic."""

from __future__ import annotations

import json
import math

import pytest
from tiny_model import EXPERT_FAMILIES, make_tiny_model

from pagedkv.config import ConfigError, default_model_path
from pagedkv.sim.plan import kv_bytes_per_block, plan_capacity
from pagedkv.sim.shapes import KNOWN_SHAPES, resolve_shape
from tests.test_cli_sim import assert_one_line_error, run_cli, run_main


def per_token(shape, dtype):
    return kv_bytes_per_block(shape, dtype, 16) / 16


def test_llama3_8b_bf16_is_128_kib_per_token():
    s = KNOWN_SHAPES["llama3-8b"]
    assert per_token(s, "auto") == per_token(s, "bfloat16") == 32 * 8 * 128 * 2 * 2 == 128 * 1024
    assert per_token(s, "float32") == 256 * 1024
    # fp8 and int8: 1 byte per element plus one float32 scale per (layer, K/V, kv head) per token
    assert per_token(s, "fp8") == per_token(s, "int8") == 64 * 1024 + 32 * 2 * 8 * 4


def test_smollm2_bf16_is_23040_bytes_per_token():
    assert per_token(KNOWN_SHAPES["smollm2-135m"], "auto") == 30 * 3 * 64 * 2 * 2 == 23040


def test_known_parameter_counts_match_the_published_ones():
    assert KNOWN_SHAPES["llama3-8b"].num_params == 8_030_261_248
    assert KNOWN_SHAPES["llama3-70b"].num_params == 70_553_706_496
    assert KNOWN_SHAPES["mistral-7b"].num_params == 7_241_732_096
    assert KNOWN_SHAPES["smollm2-135m"].num_params == 134_515_008
    assert KNOWN_SHAPES["smollm3-3b"].num_params == 3_075_098_624
    assert KNOWN_SHAPES["phi-3.5-mini"].num_params == 3_821_079_552
    assert KNOWN_SHAPES["phi-4-mini"].num_params == 3_836_021_760
    assert KNOWN_SHAPES["llama3-8b"].weight_bytes == 2 * 8_030_261_248  # bf16
    # with Qwen2's q/k/v biases and Qwen3's q/k norms
    assert KNOWN_SHAPES["qwen2.5-0.5b"].num_params == 494_032_768
    assert KNOWN_SHAPES["qwen2.5-7b"].num_params == 7_615_616_512
    assert KNOWN_SHAPES["qwen3-0.6b"].num_params == 596_049_920
    assert KNOWN_SHAPES["qwen3-8b"].num_params == 8_190_735_360
    # Gemma's (1) and Gemma 2's (its norms on the attention's and the MLP's outputs), and Gemma
    # 3's q/k norms too
    assert KNOWN_SHAPES["gemma-2b"].num_params == 2_506_172_416
    assert KNOWN_SHAPES["gemma2-2b"].num_params == 2_614_341_888
    assert KNOWN_SHAPES["gemma3-270m"].num_params == 268_098_176
    assert KNOWN_SHAPES["gemma3-1b"].num_params == 999_885_952
    # mixtures of experts: the router and every expert of every layer
    assert KNOWN_SHAPES["mixtral-8x7b"].num_params == 46_702_792_704
    assert KNOWN_SHAPES["qwen3-30b-a3b"].num_params == 30_532_122_624


@pytest.mark.parametrize(
    "arch", ["llama", "qwen2", "qwen3", "phi3", "smollm3", "gemma", "gemma2", "gemma3"]
    + list(EXPERT_FAMILIES),
)
def test_a_folder_counts_the_parameters_transformers_holds(arch, tmp_path):
    """(a mixture of experts: the router and every expert)"""
    from safetensors import safe_open
    folder = make_tiny_model(tmp_path / arch, arch=arch)
    with safe_open(f"{folder}/model.safetensors", "pt") as f:
        held = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    assert resolve_shape(model=folder).num_params == held


def test_capacity_after_weights_in_whole_blocks():
    s = KNOWN_SHAPES["llama3-8b"]
    p = plan_capacity(
        s, memory=80 * 10**9, memory_utilization=0.9, context=128000, kv_dtypes=("auto",)
    )
    kv = 72 * 10**9 - 16_060_522_496  # 55,939,477,504 bytes
    assert p.kv_memory == kv
    (row,) = p.dtypes
    assert row.bytes_per_block == 16 * 131072 and row.blocks == kv // (16 * 131072) == 26674
    assert row.tokens == 26674 * 16 == 426784
    assert row.requests_at_context == 26674 // 8000 == 3  # 128000 tokens = 8000 blocks


def test_weights_larger_than_the_budget_leave_no_kv_cache():
    p = plan_capacity(KNOWN_SHAPES["llama3-70b"], memory=80 * 10**9)
    assert p.kv_memory == 0 and all(r.tokens == 0 and r.requests_at_context == 0 for r in p.dtypes)


def test_gguf_metadata_of_the_default_model(monkeypatch):
    monkeypatch.setenv("PAGEDKV_DENSE_WEIGHTS", "0")  # the file's blocks only
    s = resolve_shape()  # no --model, no --shape: the default GGUF
    assert s.source == "gguf" and s.name == "SmolLM2-135M-Instruct.Q4_1"
    assert (s.num_layers, s.num_kv_heads, s.head_dim, s.max_context) == (30, 3, 64, 8192)
    assert s.num_params == 134_515_008
    assert (
        80 * 2**20 < s.weight_bytes < default_model_path().stat().st_size
    )  # Q4_1 tensors, not bf16
    # by default the packed matrices (all but 61 norms of 576) keep a bfloat16 copy too
    monkeypatch.delenv("PAGEDKV_DENSE_WEIGHTS")
    copies = 2 * (s.num_params - 61 * 576)
    assert resolve_shape().weight_bytes == s.weight_bytes + copies
    assert per_token(s, "auto") == 23040


def test_config_json_folder(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "num_hidden_layers": 4,
                "num_attention_heads": 8,
                "num_key_value_heads": 2,
                "hidden_size": 256,
                "intermediate_size": 512,
                "vocab_size": 1000,
                "torch_dtype": "float32",
            }
        )
    )
    s = resolve_shape(str(tmp_path))
    assert (s.num_layers, s.num_kv_heads, s.head_dim) == (4, 2, 32)
    # 1000*256*2 + 4 * (256*32*(16+4) + 3*256*512 + 512) + 256, float32 weights
    assert (
        s.num_params == 512000 + 4 * (163840 + 393216 + 512) + 256
        and s.weight_bytes == 4 * s.num_params
    )
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1234)
    assert resolve_shape(str(tmp_path / "config.json")).weight_bytes == 1234  # real file sizes win


@pytest.mark.parametrize(
    "content",
    [
        "{",
        "[]",
        '{"num_hidden_layers": 4}',
        '{"num_hidden_layers": 0, "num_attention_heads": 8, "hidden_size": 256}',
    ],
)
def test_bad_config_json_is_a_config_error(tmp_path, content):
    (tmp_path / "config.json").write_text(content)
    with pytest.raises(ConfigError):
        resolve_shape(str(tmp_path))


def test_plan_cli_table_and_json(capsys):
    rc, out, err = run_main(capsys, "plan", "--shape", "llama3-8b")
    assert rc == 0, err
    rows = {line.split()[0]: line.split() for line in out.splitlines()}
    assert rows["auto"][1:] == ["131,072", "426,784", "3"] and rows["fp8"][1] == "67,584"
    rc, alias, err = run_main(
        capsys, "plan", "--shape", "llama3-8b", "--kv-cache-dtype", "fp8_e4m3"
    )
    assert (
        rc == 0 and alias.splitlines()[-1].split() == rows["fp8"]
    )  # vLLM's name, as serve takes it
    out = run_cli(
        "plan",
        "--shape",
        "smollm2-135m",
        "--kv-cache-dtype",
        "fp8",
        "--memory",
        "1GiB",
        "--memory-utilization",
        "0.5",
        "--context",
        "4096",
        "--json",
    )
    d = json.loads(out.stdout)
    # 512 MiB - 269,030,016 bytes of bf16 weights = 267,840,896; a token is 11,520 bytes of fp8
    # plus a 4-byte scale per (layer, K/V, KV head): 30 * 2 * 3 * (64 + 4) = 12,240 bytes
    assert d["kv_memory"] == 2**29 - 2 * 134_515_008 == 267_840_896
    assert d["dtypes"] == [
        {
            "kv_cache_dtype": "fp8",
            "bytes_per_token": 12240,
            "bytes_per_block": 195840,
            "blocks": 1367,
            "tokens": 21872,
            "requests_at_context": 5,
        }
    ]


@pytest.mark.parametrize(
    "args",
    [
        ["--shape", "gpt5"],
        ["--model", "/nonexistent"],
        ["--model", "/etc/hostname"],
        ["--memory", "lots"],
        ["--memory-utilization", "1.5"],
        ["--context", "0"],
        ["--block-size", "0"],
        ["--kv-cache-dtype", "int4"],
        ["--shape", "llama3-8b", "--model", "x.gguf"],
    ],
)
def test_plan_bad_flags_are_one_line_and_exit_2(capsys, args):
    assert_one_line_error(*run_main(capsys, "plan", *args))


def test_truncated_gguf_is_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(default_model_path().read_bytes()[:100_000])
    out = run_cli("plan", "--model", str(bad))
    assert_one_line_error(out.returncode, out.stdout, out.stderr)
    assert "cut.gguf" in out.stderr

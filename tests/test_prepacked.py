"""Weights prepacked, in every form: bfloat16 in our GEMM's panels of k pairs ("pairs", within a
bfloat16 rounding step of F.linear: other summation order) and in oneDNN's layout (the same bits
as F.linear); float32 in our GEMM's panels ("panels", within float32 rounding of the exact
product); for a matmul alone and for a whole model; a tied lm_head gets its own copy (counted,
and planned).

Where this CPU runs a form not (no AVX512_BF16 for pairs, no AVX-512 for oneDNN's, a build other
than AVX-512 or AVX2 for panels), the tests check that the form is not chosen, that the weights
stay plain tensors and the model runs as before."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_model_vs_hf import PagedDriver, Seq
from tiny_model import make_tiny_model

from pagedkv import native
from pagedkv.model import prepacked
from pagedkv.model.loader import load_model
from pagedkv.model.prepacked import PrepackedWeight, prepack
from pagedkv.model.quant_linear import Blocks, pack_int4
from pagedkv.sim.shapes import resolve_shape

PROMPT = "Paged attention keeps the KV cache in blocks. Hello world!"


@pytest.fixture
def prepacking(monkeypatch):
    """Sets $PAGEDKV_PREPACK for the loads inside the test (form() is cached per process) and
    returns whether weights are prepacked then."""

    def use(setting: str) -> bool:
        monkeypatch.setenv(prepacked.ENV, setting)
        for cached in (prepacked.form, prepacked.float32_form, prepacked.int4_form):
            cached.cache_clear()
        return prepacked.supported()

    yield use
    monkeypatch.delenv(prepacked.ENV, raising=False)
    for cached in (prepacked.form, prepacked.float32_form, prepacked.int4_form):
        cached.cache_clear()


def close_to_f_linear(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> bool:
    """Within what rounding of the result to its dtype and float32 sums in any order allow of the
    exact product (a result that cancels to near 0 keeps only the sums' absolute error): for
    bfloat16 a rounding step of the result, for float32 k roundings of the sums (the worst case
    of any order, where the result is not rounded again)."""
    exact = x.double() @ w.double().T
    sums = 2**-22 if got.dtype == torch.bfloat16 else x.shape[1] * 2**-24
    step = 2**-8 if got.dtype == torch.bfloat16 else 0
    bound = exact.abs() * step + (x.double().abs() @ w.double().abs().T) * sums
    assert ((F.linear(x, w).double() - exact).abs() <= bound).all()  # (the bound holds for torch)
    return bool(((got.double() - exact).abs() <= bound).all())


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("tied"), tie=True)


def float32_panels_run() -> bool:
    lib = native.library()
    return lib is not None and lib.isa in ("avx512", "avx2") and prepacked._probe("panels")


@pytest.mark.parametrize("kind", ["pairs", "onednn", "panels"])
@pytest.mark.parametrize(
    "shape",
    # (2048, 1536): a thread's panels span several of AMX's groups (gemm.cpp, kAmxGroupBytes)
    [
        (64, 96),
        (960, 576),
        (100, 36),
        (72, 1536),
        (688, 96),
        (48, 64),
        (31, 2),
        (5, 3),
        (2048, 1536),
    ],
)
def test_a_prepacked_matmul_is_f_linear(kind, shape, prepacking):
    gen = torch.Generator().manual_seed(1)
    dtype = torch.float32 if kind == "panels" else torch.bfloat16
    w = torch.randn(shape, generator=gen).to(dtype)
    if kind == "panels" and not float32_panels_run():
        prepacking("")
        assert prepacked.float32_form() == "plain" and prepack(w) is w
        return
    if kind != "panels" and not prepacked._probe(kind):  # this CPU lacks it: not chosen
        prepacking("" if kind == "pairs" else "onednn")
        assert prepacked.form() != kind
        return
    if kind == "pairs" and shape[1] % 2:
        return  # (k in pairs: such a weight stays plain, test_the_gemm_refuses_...)
    packed = PrepackedWeight.of(w, kind)
    assert packed.shape == shape
    if kind == "pairs":  # every value once, no padding: memory is what the plan counts
        assert packed.nbytes == w.numel() * 2
    if kind == "panels":  # padded to whole panels of 2 vectors
        cols = 2 * native.library().vector_width
        assert packed.nbytes == -(-shape[0] // cols) * cols * shape[1] * 4
    threads = torch.get_num_threads()
    try:
        for rows, t in ((1, 1), (3, 2), (17, 3), (64, 2), (64, 16), (300, 2), (301, 3)):
            torch.set_num_threads(t)
            x = torch.randn(rows, shape[1], generator=gen).to(dtype)
            got = packed.mm(x)
            # oneDNN's form gives F.linear's bits where oneDNN picks the same kernel for both
            # (not always on AMX CPUs, which take tiles for one and not the other at some rows)
            assert close_to_f_linear(got, x, w), (rows, t)
            if kind == "onednn" and not native.library().amx:
                assert torch.equal(got, F.linear(x, w)), rows
            assert torch.equal(packed.mm(x.view(1, rows, -1)), got.view(1, rows, -1))
            # many rows take whole panels two at a time: the same sums. With AMX, 8 rows and more
            # take tiles (a sum's order of their own), which do not depend on the other rows either
            first = 8 if native.library().amx and shape[1] % 32 == 0 else 5
            if kind == "pairs" and rows >= first:
                assert torch.equal(packed.mm(x[:first]), got[:first]), rows
            assert torch.equal(packed.mm(x.t().contiguous().t()), got)  # (rows of any stride)
    finally:
        torch.set_num_threads(threads)
    prepacking("0")
    assert prepack(w) is w
    prepacking("onednn")  # (the libraries' matmuls: oneDNN's form for bfloat16, float32 plain)
    assert (prepack(w) is w) == (kind == "panels")


def test_the_gemm_refuses_what_it_cannot_multiply():
    lib = native.library()
    if lib is None or not lib.bf16_gemm:
        assert prepacked._probe("pairs") is False
        return
    x, w, out = (torch.zeros(4, 6, dtype=torch.bfloat16) for _ in range(3))
    fields = dict(
        x=x.data_ptr(), x_stride=6, w=w.data_ptr(), out=out.data_ptr(), out_stride=4, rows=4, n=4
    )
    with pytest.raises(native.KernelError, match="even k"):
        lib.call("gemm_bf16", **fields, k=5, threads=1)
    with pytest.raises(native.KernelError, match="row strides"):
        lib.call("gemm_bf16", **{**fields, "x_stride": 4}, k=6, threads=1)
    if prepacked.form() == "pairs":  # an odd k stays plain
        odd = torch.zeros(4, 5, dtype=torch.bfloat16)
        assert prepack(odd) is odd


def test_a_setting_that_is_no_form_is_refused(prepacking):
    with pytest.raises(ValueError, match="PAGEDKV_PREPACK='fast': want 0, onednn, or unset"):
        prepacking("fast")


@pytest.mark.parametrize(
    "dtype,setting",
    [(torch.bfloat16, ""), (torch.bfloat16, "onednn"), (torch.float32, ""), (torch.float32, "0")],
)
def test_a_prepacked_model_gives_the_same_greedy_tokens(tied_model, prepacking, dtype, setting):
    """oneDNN's form: the same bits; pairs: within bfloat16 rounding; panels: within float32
    rounding; the same greedy tokens in each."""
    on = prepacking(setting)
    kind = prepacked.form() if dtype == torch.bfloat16 else prepacked.float32_form()
    if dtype == torch.float32:
        on = kind == "panels"
        assert on == (setting == "" and float32_panels_run())
    fast = load_model(tied_model, dtype, quantization="none")
    prepacking("0")
    plain = load_model(tied_model, dtype, quantization="none")
    layer = fast.model.layers[0]
    kinds = {type(w) for w in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)}
    assert kinds == ({PrepackedWeight} if on else {torch.nn.Parameter})
    assert {getattr(w, "kind", "plain") for w in (layer.qkv_proj, fast.model.lm_head)} == {kind}
    assert isinstance(plain.model.layers[0].qkv_proj, torch.nn.Parameter)
    assert plain.model.lm_head is plain.model.embed_tokens
    assert isinstance(fast.model.embed_tokens, torch.Tensor)  # lookups need the plain rows
    assert isinstance(fast.model.lm_head, PrepackedWeight if on else torch.Tensor)
    vocab, hidden = fast.config.vocab_size, fast.config.hidden_size
    cols = 2 * native.library().vector_width if kind == "panels" else 1  # (panels are padded)
    extra = -(-vocab // cols) * cols * hidden * dtype.itemsize if on else 0  # the head's copy
    padding = fast.model.weight_bytes() - plain.model.weight_bytes() - extra
    assert (
        padding == 0
        if kind != "panels"
        else 0 <= padding < 4 * cols * 4 * hidden * len(fast.model.layers)
    )
    ids = fast.tokenizer.encode(PROMPT)
    drivers = [PagedDriver(m, 16) for m in (fast, plain)]
    seqs = [Seq(list(ids)) for _ in drivers]
    for _ in range(4):
        a, b = (d.step([(s, len(s.tokens) - s.computed)]) for d, s in zip(drivers, seqs))
        if kind == "pairs":
            assert (a - b).abs().max() <= 0.03 * b.abs().max(), (a - b).abs().max()
        elif kind == "panels":
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * b.abs().max().item())
        else:
            assert torch.equal(a, b)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        for s in seqs:
            s.tokens.append(int(b[0].argmax()))


def test_plan_counts_the_tied_head_copy(tied_model, tmp_path, prepacking):
    from test_loaders import hf_to_gguf

    on = prepacking("")
    gguf = hf_to_gguf(Path(tied_model), tmp_path / "tied.gguf")
    lm = load_model(str(gguf), torch.bfloat16, quantization="none")
    assert (lm.model.lm_head is lm.model.embed_tokens) is not on
    assert resolve_shape(str(gguf), quantization="none").weight_bytes == lm.model.weight_bytes()


@pytest.mark.parametrize(
    "n,k,group", [(64, 64, 32), (128, 576, 32), (192, 1536, 64), (64, 256, 128)]
)
def test_int4_panels_hold_aten_layouts_weights_and_multiply_them(
    n, k, group, prepacking, kernel_isa
):
    """4-bit weights in our GEMM's panels (where it runs: AVX512_BF16 builds, and AVX2 builds by
    dequantizing into float32): the same values as aten's layout, whole, by rows (embedding
    lookups) and in parts; products within rounding of the float64 one; per ISA variant."""
    gen = torch.Generator().manual_seed(n + k)
    scale, zero = torch.rand(2, n, k // group, generator=gen) * 0.01
    b = Blocks(
        torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8),
        scale,
        zero - 0.005,
        group,
        4,
    )
    prepacking("onednn")
    aten = pack_int4(b)
    prepacking("")
    lib = native.library()
    if not (lib.isa == "avx2" or prepacked.form() == "pairs"):
        assert prepacked.int4_form() == "aten" and not pack_int4(b).panels  # torch's kernel here
        return
    assert prepacked.int4_form() == "panels"
    ours = pack_int4(b)
    assert ours.panels and not aten.panels and ours.packed_nbytes == aten.packed_nbytes
    w = aten.dequantize()
    assert torch.equal(ours.dequantize(), w)
    ids = torch.tensor([0, 5, 17, 31, 32, 47, n - 1])
    assert torch.equal(ours.rows(ids, torch.float32), w[ids])
    assert torch.equal(ours.part(32, 64).dequantize(), w[32:64])
    threads = torch.get_num_threads()
    try:
        for rows, t in ((1, 1), (5, 2), (6, 2), (7, 3), (13, 2), (64, 16)):
            torch.set_num_threads(t)
            x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
            exact = x.double() @ w.double().T
            bound = exact.abs() * 2**-8 + (x.double().abs() @ w.double().abs().T) * 2**-20
            assert ((ours.packed_mm(x).double() - exact).abs() <= bound).all(), (rows, t)
            # float32 activations as they are: through bf16 rows with AVX512_BF16 (x and the
            # result rounded as torch would round them), else float32 FMAs from end to end
            xf = torch.randn(rows, k, generator=gen)
            assert ours.takes(torch.float32)
            out = torch.empty(rows, n)
            got = ours.mm(xf, out)
            exact, size = xf.double() @ w.double().T, xf.double().abs() @ w.double().abs().T
            tol = 2**-7 if lib.bf16_gemm else k * 2**-23
            assert got.data_ptr() == out.data_ptr(), "written where it was asked"
            assert ((got.double() - exact).abs() <= size * tol).all(), (rows, t)
            if lib.bf16_gemm:
                via_bf16 = ours.packed_mm(xf.to(torch.bfloat16)).float()
                assert torch.equal(got, via_bf16)
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(native.KernelError, match="multiple of 32"):
        lib.call(
            "gemm_int4", x=0, x_stride=k, codes=0, scales=0, out=0, out_stride=48, rows=1, n=48,
            k=k, group=group, threads=1, dtype=native.DTYPES[torch.bfloat16],
        )  # fmt: skip
    with pytest.raises(native.KernelError, match="bfloat16 or float32"):
        lib.call(
            "gemm_int4", x=0, x_stride=k, codes=0, scales=0, out=0, out_stride=n, rows=1, n=n,
            k=k, group=group, threads=1, dtype=native.DTYPES[torch.float16],
        )  # fmt: skip

"""The state dict of a model patched with ``weights="fp8"`` round-trips: each fused slice saves
its rows of the e4m3 weight and of the scales under its stock name (``q_proj.weight_scale``:
its rows of the (N,) per-channel scale, its block rows of the (N/128, K/128) block scale), a
second model patched the same way loads it strictly and computes bit-identical logits, through
``load_state_dict``, torch.save/torch.load and safetensors files alike; what does not fit (a
bf16 weight, a misshapen or NaN scale, a missing part) is reported under the stock names.
Tiny random Llama, fp16, CPU."""

from __future__ import annotations

import pytest
import torch

import hybridgemm
from hybridgemm.fp8_modules import FP8FusedLinears, FP8HybridLinear

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

VOCAB = 96
GRANULARITIES = ["channel", "block128"]


def _model(seed: int) -> torch.nn.Module:
    """Hidden, intermediate and head sizes multiples of 128 (block128 fuses Q/K/V and gate/up)."""
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=384, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=128, num_hidden_layers=2,
                                   max_position_embeddings=32)
    return transformers.LlamaForCausalLM(cfg).half().eval()


def _patched(seed: int, granularity: str) -> torch.nn.Module:
    model = _model(seed)
    report = hybridgemm.patch(model, weights="fp8", granularity=granularity)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert isinstance(attn.qkv_proj, FP8FusedLinears) and isinstance(mlp.gate_up_proj, FP8FusedLinears), report
    assert isinstance(attn.o_proj, FP8HybridLinear) and len(report.fp8) == 8, report
    return model


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _assert_same_state(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)), k  # bytes, e4m3 included


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_fused_slices_save_their_rows_of_the_scales(granularity):
    model = _patched(0, granularity)
    sd = model.state_dict()
    attn = model.model.layers[0].self_attn
    w, s = attn.qkv_proj.weight, attn.qkv_proj.weight_scale
    rows = {"q_proj": (0, 256), "k_proj": (256, 384), "v_proj": (384, 512)}
    for name, (lo, hi) in rows.items():
        key = f"model.layers.0.self_attn.{name}"
        assert torch.equal(sd[f"{key}.weight"].view(torch.uint8), w[lo:hi].view(torch.uint8))
        want = s[lo:hi] if granularity == "channel" else s[lo // 128:hi // 128]
        assert sd[f"{key}.weight_scale"].dtype == torch.float32 and torch.equal(sd[f"{key}.weight_scale"], want)
    assert "model.layers.0.self_attn.qkv_proj.weight_scale" not in sd
    n, k = 384, 256  # gate_proj
    shape = (n,) if granularity == "channel" else (n // 128, k // 128)
    assert sd["model.layers.1.mlp.gate_proj.weight_scale"].shape == shape
    # each part's rows dequantize to its stock linear's weight (quantized from the weights kept here)
    ref = _model(0)
    q = ref.model.layers[1].mlp.up_proj.weight.float()
    deq = hybridgemm.FP8Weight.from_tensors(sd["model.layers.1.mlp.up_proj.weight"],
                                            sd["model.layers.1.mlp.up_proj.weight_scale"]).dequantize(torch.float32)
    assert (deq - q).abs().max() <= q.abs().max() / 16  # e4m3: 3 mantissa bits


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_strict_load_into_a_second_patched_model_is_bit_exact(granularity, tmp_path):
    src, dst = _patched(0, granularity), _patched(1, granularity)
    ids = torch.randint(1, VOCAB, (2, 7))
    want = _logits(src, ids)
    assert not torch.equal(_logits(dst, ids), want)  # a different random init computes something else
    sd = src.state_dict()
    result = dst.load_state_dict(sd, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    assert torch.equal(_logits(dst, ids), want)
    _assert_same_state(dst.state_dict(), sd)

    # through files: torch.save and safetensors
    torch.save(sd, tmp_path / "sd.pt")
    third = _patched(2, granularity)
    third.load_state_dict(torch.load(tmp_path / "sd.pt", weights_only=True), strict=True)
    assert torch.equal(_logits(third, ids), want)
    safetensors_torch.save_file(sd, tmp_path / "model.safetensors")
    loaded = safetensors_torch.load_file(tmp_path / "model.safetensors")
    _assert_same_state({k: loaded[k] for k in sd}, sd)
    fourth = _patched(3, granularity)
    fourth.load_state_dict(loaded, strict=True)
    assert torch.equal(_logits(fourth, ids), want)
    _assert_same_state(fourth.state_dict(), sd)


def test_bad_fp8_entries_are_reported_under_stock_names():
    model = _patched(0, "channel")
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    q = "model.layers.0.self_attn.q_proj"
    bad = dict(sd)
    bad[f"{q}.weight"] = sd[f"{q}.weight"].to(torch.float16)  # would be cast to e4m3 without its scales
    with pytest.raises(RuntimeError, match=rf"{q}.weight: an FP8 weight loads e4m3"):
        model.load_state_dict(bad)
    bad = dict(sd)
    bad[f"{q}.weight"] = sd[f"{q}.weight"].clone()
    bad[f"{q}.weight"].view(torch.uint8)[2, 7] = 0x7F  # e4m3fn NaN
    with pytest.raises(RuntimeError, match=rf"{q}.weight: FP8 weight data holds 1 NaN values"):
        model.load_state_dict(bad)
    bad = dict(sd)
    bad[f"{q}.weight_scale"] = sd[f"{q}.weight_scale"][:-1]
    with pytest.raises(RuntimeError, match=rf"size mismatch for {q}.weight_scale"):
        model.load_state_dict(bad)
    bad = dict(sd)
    bad[f"{q}.weight_scale"] = sd[f"{q}.weight_scale"].clone()
    bad[f"{q}.weight_scale"][3] = float("nan")
    with pytest.raises(RuntimeError, match=rf"{q}.weight_scale: .*must be finite and > 0: 1 of 256 .*nan"):
        model.load_state_dict(bad)
    o = "model.layers.1.self_attn.o_proj"
    bad = dict(sd)
    bad[f"{o}.weight_scale"] = -sd[f"{o}.weight_scale"]
    with pytest.raises(RuntimeError, match=rf"{o}.weight_scale: .*must be finite and > 0"):
        model.load_state_dict(bad)
    _assert_same_state(model.state_dict(), sd)  # the refused entries were never copied
    partial = {k: v for k, v in sd.items() if k != f"{q}.weight_scale"}
    partial[f"{q}.weight"] = torch.zeros_like(sd[f"{q}.weight"])
    result = model.load_state_dict(partial, strict=False)
    assert result.missing_keys == [f"{q}.weight_scale"] and not result.unexpected_keys
    got = model.state_dict()
    assert torch.equal(got[f"{q}.weight_scale"], sd[f"{q}.weight_scale"])  # an absent part keeps its value
    assert not got[f"{q}.weight"].float().any()
    with pytest.raises(RuntimeError, match=rf'Missing key\(s\) in state_dict: "{q}.weight_scale"\. '):
        model.load_state_dict(partial, strict=True)

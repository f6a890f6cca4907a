"""``patch`` of a model loaded from an FP8 checkpoint takes its e4m3 weights and scales as they
are. Checkpoints are written here by the libraries themselves from a tiny random Llama:
compressed-tensors ``float-quantized`` (its ``apply_quantization_config`` and
``ModelCompressor``, scales set as calibration would set them) per channel with static or
dynamic activations, per tensor and per 128x128 block; transformers' fine-grained FP8 (its
``Fp8Quantize`` op, the checkpoint's ``quantization_config``) with dynamic or static
activations. transformers loads them (``from_pretrained``, CPU); the patched model's logits are
compared with an fp32 model of the checkpoint's dequantized weights (and with the unpatched
compressed-tensors model, which on CPU decompresses itself on its first forward), its state
dict with the checkpoint file (keys, order, dtypes, bytes). Bad scales raise FP8FormatError.

On a machine without a GPU transformers does not keep a fine-grained FP8 checkpoint in FP8:
without accelerate its quantizer raises ImportError ("Loading an FP8 quantized model requires
accelerate"), with it it dequantizes the model to bf16. The tests load it as a GPU machine
would (FP8Linear modules, e4m3 weights) by skipping that environment check."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from torch import nn

import hybridgemm
from hybridgemm.fp8_modules import FP8FusedLinears, FP8HybridLinear
from hybridgemm.kernels.fp8 import FP8FormatError

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")
ct_quant = pytest.importorskip("compressed_tensors.quantization")
ct_compressors = pytest.importorskip("compressed_tensors.compressors")
from compressed_tensors.quantization import quant_scheme  # noqa: E402
from transformers.integrations import finegrained_fp8  # noqa: E402
from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer  # noqa: E402

VOCAB = 96
LAYER = "model.layers.0"
E4M3 = torch.float8_e4m3fn
# (weights, activations) of each compressed-tensors checkpoint: the FP8 preset schemes and the
# per-channel weights of "-FP8" releases with statically calibrated activations
CT_SCHEMES = {
    "ct_channel_static": ("FP8_DYNAMIC", "FP8"),
    "ct_channel_dynamic": ("FP8_DYNAMIC", "FP8_DYNAMIC"),
    "ct_tensor_static": ("FP8", "FP8"),
    "ct_block_dynamic": ("FP8_BLOCK", "FP8_BLOCK"),
}
TF_SCHEMES = {"tf_block_dynamic": "dynamic", "tf_block_static": "static"}
FORMATS = [*CT_SCHEMES, *TF_SCHEMES]
STATIC = {"ct_channel_static", "ct_tensor_static", "tf_block_static"}


def _bf16_model(seed: int) -> nn.Module:
    """Hidden, intermediate and head sizes multiples of 128: block scales fuse too."""
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=384, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=128, num_hidden_layers=2,
                                   max_position_embeddings=32)
    return transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()


def _write_ct(path, name: str, seed: int) -> None:
    weights, acts = (getattr(quant_scheme, s) for s in CT_SCHEMES[name])
    model = _bf16_model(seed)
    scheme = ct_quant.QuantizationScheme(targets=["Linear"], weights=weights["weights"],
                                         input_activations=acts["input_activations"])
    config = ct_quant.QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"],
                                         quantization_status="calibration")
    ct_quant.apply_quantization_config(model, config)
    with torch.no_grad():  # what calibration sets: amax / 448 per channel, tensor or block; an input scale
        for mod in model.modules():
            if hasattr(mod, "weight_scale"):
                w, shape = mod.weight.float(), mod.weight_scale.shape
                if shape[-1] == 1 and len(shape) == 2:
                    amax = w.abs().amax(1, keepdim=True)
                elif mod.weight_scale.numel() == 1:
                    amax = w.abs().amax()
                else:
                    amax = w.unflatten(0, (shape[0], -1)).unflatten(-1, (shape[1], -1)).abs().amax((1, 3))
                mod.weight_scale.copy_((amax / 448).reshape(shape))
            if hasattr(mod, "input_scale"):
                mod.input_scale.fill_(0.02)
    compressor = ct_compressors.ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(path)


def _write_tf(path, name: str, seed: int) -> None:
    """A fine-grained FP8 checkpoint: transformers' own quantize op on every decoder-layer
    projection, the quantization_config such checkpoints carry."""
    _bf16_model(seed).save_pretrained(path)
    activations = TF_SCHEMES[name]
    config = transformers.FineGrainedFP8Config(weight_block_size=(128, 128), activation_scheme=activations)
    quantize = finegrained_fp8.Fp8Quantize(type("Quantizer", (), {"quantization_config": config})())
    plain = safetensors_torch.load_file(path / "model.safetensors")
    tensors = {}
    for key, value in plain.items():
        if key.startswith("model.layers.") and key.endswith("_proj.weight"):
            tensors.update(quantize.convert({key: value}))
            if activations == "static":
                tensors[key.removesuffix("weight") + "activation_scale"] = torch.tensor(0.02)
        else:
            tensors[key] = value
    safetensors_torch.save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": activations,
                                  "weight_block_size": [128, 128]}
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> folder, two seeds each (a second model to load the first one's state dict into)."""
    root = tmp_path_factory.mktemp("fp8_checkpoints")
    cache = {}

    def get(name: str, seed: int = 0):
        if (name, seed) not in cache:
            path = root / f"{name}_{seed}"
            (_write_ct if name in CT_SCHEMES else _write_tf)(path, name, seed)
            cache[name, seed] = path
        return cache[name, seed]

    return get


@pytest.fixture
def load(monkeypatch):
    # a GPU machine's module state on CPU: see the module docstring
    monkeypatch.setattr(FineGrainedFP8HfQuantizer, "validate_environment", lambda self, *args, **kwargs: None)

    def load(path):
        return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()

    return load


def _dequantized(path) -> dict:
    """The checkpoint's tensors with every e4m3 weight times its scales in fp32 (per channel,
    tensor or 128 x 128 block, as the scale's shape says) and the scales dropped."""
    tensors = safetensors_torch.load_file(path / "model.safetensors")
    out = {}
    for key, t in tensors.items():
        if t.dtype != E4M3:
            if not key.endswith(("_scale", "_scale_inv")):
                out[key] = t.float()
            continue
        base = key.removesuffix("weight")
        scale = tensors.get(base + "weight_scale", tensors.get(base + "weight_scale_inv")).float()
        w = t.float()
        if scale.numel() == 1 or scale.shape == (w.shape[0], 1):
            out[key] = w * scale.reshape(-1, 1)
        else:
            full = scale.repeat_interleave(128, 0)[:w.shape[0]].repeat_interleave(128, 1)[:, :w.shape[1]]
            out[key] = w * full
    return out


def _reference(path) -> nn.Module:
    """An fp32 model of the checkpoint's dequantized weights (no activation quantization)."""
    cfg = transformers.LlamaConfig.from_pretrained(path)
    del cfg.quantization_config
    ref = transformers.LlamaForCausalLM(cfg).float().eval()
    ref.load_state_dict(_dequantized(path), strict=False)  # lm_head is tied or stored
    missing = set(ref.state_dict()) - set(_dequantized(path))
    assert missing <= {"lm_head.weight"}, missing
    return ref


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.float()


def _rel(got, want) -> float:
    return float((got - want).abs().max() / want.abs().max())


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def _assert_same_tensors(got: dict, want: dict) -> None:
    assert set(got) == set(want), set(got) ^ set(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, (k, got[k].dtype, want[k].dtype)
        assert torch.equal(_bytes(got[k]), _bytes(want[k])), k


@pytest.mark.parametrize("fmt", FORMATS)
def test_patch_takes_the_checkpoints_fp8_weights_as_they_are(fmt, checkpoints, load):
    path = checkpoints(fmt)
    model = load(path)
    stock_keys = list(model.state_dict())
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attn.o_proj.weight.dtype == E4M3  # transformers kept the checkpoint's FP8
    o_data, q_bytes = attn.o_proj.weight.data_ptr(), _bytes(attn.q_proj.weight).clone()
    report = hybridgemm.patch(model)

    fp8 = [f"model.layers.{i}.{m}" for i in (0, 1) for m in ("self_attn.qkv_proj", "mlp.gate_up_proj",
                                                              "self_attn.o_proj", "mlp.down_proj")]
    assert sorted(report.fp8) == sorted(fp8), report
    assert sorted(report.fused_layers) == ["model.layers.0", "model.layers.1"], report  # the fused decode step
    assert isinstance(attn.qkv_proj, FP8FusedLinears) and isinstance(mlp.gate_up_proj, FP8FusedLinears)
    assert type(attn.o_proj) is FP8HybridLinear and type(mlp.down_proj) is FP8HybridLinear
    assert attn.o_proj.weight.data_ptr() == o_data  # the checkpoint's tensor itself
    assert torch.equal(_bytes(attn.qkv_proj.weight[:256]), q_bytes)  # the e4m3 rows, concatenated
    assert all(p.dtype == E4M3 for n, p in model.named_parameters() if "layers" in n and n.endswith("proj.weight"))
    static = [n for n, why in report.skipped if "static activation scale" in why]
    if fmt in STATIC:  # reported, not dropped: 7 projections per layer
        assert len(static) == 14 and f"{LAYER}.self_attn.q_proj" in static, report.skipped
    else:
        assert not report.skipped, report.skipped

    # the state dict is the checkpoint's: keys and order of the loaded model, dtypes and bytes of the file
    sd = model.state_dict()
    assert list(sd) == stock_keys
    _assert_same_tensors(sd, safetensors_torch.load_file(path / "model.safetensors"))


@pytest.mark.parametrize("fmt", FORMATS)
def test_patched_logits_match_the_dequantized_checkpoint(fmt, checkpoints, load):
    path = checkpoints(fmt)
    ids = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    want = _logits(_reference(path), ids)
    model = load(path)
    hybridgemm.patch(model)
    got = _logits(model, ids)
    assert _rel(got, want) < 2e-2, _rel(got, want)  # bf16 activations against fp32
    if fmt in CT_SCHEMES:  # the unpatched model: decompressed on its first forward, activations fake-quantized
        stock = _logits(load(path), ids)
        assert _rel(stock, want) < 0.15 and _rel(got, want) < _rel(stock, want)
    bf16_logits = _logits(_bf16_model(0), ids)  # the weights before quantization: FP8's own error shows
    assert 1e-3 < _rel(got, bf16_logits.float()) < 0.2


@pytest.mark.parametrize("fmt", FORMATS)
def test_state_dict_round_trips_in_the_checkpoints_format(fmt, checkpoints, load, tmp_path):
    src, dst = load(checkpoints(fmt, 0)), load(checkpoints(fmt, 1))
    hybridgemm.patch(src)
    hybridgemm.patch(dst)
    ids = torch.randint(1, VOCAB, (2, 5))
    want = _logits(src, ids)
    assert not torch.equal(_logits(dst, ids), want)
    sd = src.state_dict()
    safetensors_torch.save_file(sd, tmp_path / "model.safetensors")
    loaded = safetensors_torch.load_file(tmp_path / "model.safetensors")
    _assert_same_tensors(loaded, sd)
    result = dst.load_state_dict(loaded, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    assert torch.equal(_logits(dst, ids), want)
    _assert_same_tensors(dst.state_dict(), sd)
    # the original checkpoint file loads the same way
    third = load(checkpoints(fmt, 1))
    hybridgemm.patch(third)
    third.load_state_dict(safetensors_torch.load_file(checkpoints(fmt, 0) / "model.safetensors"), strict=True)
    assert torch.equal(_logits(third, ids), want)


def _with(path, tmp_path, key: str, edit) -> object:
    out = tmp_path / "edited"
    shutil.copytree(path, out)
    tensors = safetensors_torch.load_file(out / "model.safetensors")
    tensors[key] = edit(tensors[key]).contiguous()
    safetensors_torch.save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("fmt", ["ct_channel_static", "tf_block_dynamic"])
def test_nan_scales_raise_at_patch_time_and_change_nothing(fmt, checkpoints, load, tmp_path):
    name = "weight_scale" if fmt in CT_SCHEMES else "weight_scale_inv"
    key = f"model.layers.1.mlp.up_proj.{name}"

    def poison(t):
        t = t.clone()
        t.view(-1)[1] = float("nan")
        return t

    model = load(_with(checkpoints(fmt), tmp_path, key, poison))
    before = {k: _bytes(v).clone() for k, v in model.state_dict().items()}
    classes = {n: type(m) for n, m in model.named_modules()}
    with pytest.raises(FP8FormatError, match=rf"hybridgemm.patch: {key}: .*finite and > 0: 1 of .*nan"):
        hybridgemm.patch(model)
    assert {n: type(m) for n, m in model.named_modules()} == classes
    assert all(torch.equal(_bytes(v), before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("fmt", ["ct_channel_static", "tf_block_dynamic"])
def test_nan_weights_raise_at_patch_time_and_change_nothing(fmt, checkpoints, load, tmp_path):
    key = "model.layers.0.self_attn.k_proj.weight"

    def poison(t):
        t = t.clone()
        t.view(torch.uint8).view(-1)[3] = 0xFF  # e4m3fn NaN
        return t

    model = load(_with(checkpoints(fmt), tmp_path, key, poison))
    before = {k: _bytes(v).clone() for k, v in model.state_dict().items()}
    with pytest.raises(FP8FormatError, match=rf"hybridgemm.patch: {key}: .*1 NaN values"):
        hybridgemm.patch(model)
    assert all(torch.equal(_bytes(v), before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("fmt", ["ct_channel_dynamic", "tf_block_dynamic"])
def test_misshapen_scales_raise_a_clear_error(fmt, checkpoints, load, tmp_path):
    name = "weight_scale" if fmt in CT_SCHEMES else "weight_scale_inv"
    key = f"{LAYER}.self_attn.k_proj.{name}"
    stated = "channel" if fmt in CT_SCHEMES else "block"
    message = (rf"{key} has shape \(1, 1\), which does not fit its \(128, 256\) e4m3 weight \(its quantization "
               rf"states {stated}\): per channel \(128, 1\).*per 128x128 block \(1, 2\)")
    # transformers (5.2x) refuses such a file itself; releases that load it leave it to patch
    try:
        loaded = load(_with(checkpoints(fmt), tmp_path, key, lambda t: t[:1, :1]))
    except RuntimeError as e:
        assert "ignore_mismatched_sizes" in str(e)
    else:
        with pytest.raises(FP8FormatError, match=message):
            hybridgemm.patch(loaded)
    # a module holding one (a state built another way) is refused by patch
    model = load(checkpoints(fmt))
    classes = {n: type(m) for n, m in model.named_modules()}
    k_proj = model.model.layers[0].self_attn.k_proj
    setattr(k_proj, name, nn.Parameter(getattr(k_proj, name).detach()[:1, :1].clone(), requires_grad=False))
    with pytest.raises(FP8FormatError, match=message):
        hybridgemm.patch(model)
    assert {n: type(m) for n, m in model.named_modules()} == classes  # nothing was changed


def test_group_scales_are_left_as_loaded_with_the_reason(tmp_path, load):
    """Group-wise FP8 scales (compressed-tensors ``group`` strategy): not a layout the kernels
    read; the modules stay as loaded (and decompress themselves, as unpatched)."""
    model = _bf16_model(0)
    weights = ct_quant.QuantizationArgs(num_bits=8, type="float", strategy="group", group_size=128, symmetric=True,
                                        dynamic=False)
    scheme = ct_quant.QuantizationScheme(targets=["Linear"], weights=weights)
    ct_quant.apply_quantization_config(model, ct_quant.QuantizationConfig(
        config_groups={"group_0": scheme}, ignore=["lm_head"], quantization_status="calibration"))
    with torch.no_grad():
        for mod in model.modules():
            if hasattr(mod, "weight_scale"):
                w = mod.weight.float().unflatten(-1, (mod.weight_scale.shape[1], -1))
                mod.weight_scale.copy_(w.abs().amax(-1) / 448)
    compressor = ct_compressors.ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(tmp_path)
    compressor.update_config(tmp_path)
    ids = torch.randint(1, VOCAB, (1, 6))
    want = _logits(load(tmp_path), ids)

    model = load(tmp_path)
    report = hybridgemm.patch(model)
    reasons = dict(report.skipped)
    assert "group-wise" in reasons[f"{LAYER}.self_attn.q_proj"], report.skipped
    assert "not plain nn.Linear" in reasons[f"{LAYER}.self_attn"], report.skipped
    assert not report.fp8 and type(model.model.layers[0].self_attn.o_proj) is nn.Linear
    assert model.model.layers[0].self_attn.o_proj.weight.dtype == E4M3
    assert torch.equal(_logits(model, ids), want)


@pytest.mark.parametrize("kind", ["compressed_tensors_fp8_linear", "fine_grained_per_tensor"])
def test_other_fp8_linear_modules(kind):
    """compressed-tensors' FP8 kernel module (scale (1, N) fp32, as transformers loads it on an
    FP8 GPU) and transformers' FP8Linear with one scale per tensor (block_size None)."""
    torch.manual_seed(0)
    n, k = 96, 80
    w = torch.randn(n, k)
    if kind == "compressed_tensors_fp8_linear":
        try:
            from transformers.integrations.compressed_tensors import CompressedTensorsFP8Linear
        except ImportError:
            pytest.skip("this transformers has no CompressedTensorsFP8Linear (transformers 5.14 and later have)")

        lin = CompressedTensorsFP8Linear(k, n, has_bias=True)
        scale = w.abs().amax(1) / 448
        lin.weight_scale = nn.Parameter(scale.reshape(1, n), requires_grad=False)
        name = "weight_scale"
    else:
        lin = finegrained_fp8.FP8Linear(k, n, block_size=None, has_bias=True)
        scale = w.abs().amax() / 448
        lin.weight_scale_inv = nn.Parameter(scale.clone(), requires_grad=False)
        scale = scale.expand(n)
        name = "weight_scale_inv"
    with torch.no_grad():
        lin.weight = nn.Parameter((w / scale[:, None]).to(E4M3), requires_grad=False)
        lin.bias = nn.Parameter(torch.randn(n).to(torch.bfloat16), requires_grad=False)
    holder = nn.Module()
    holder.lm_head = lin
    before = {key: _bytes(v).clone() for key, v in holder.state_dict().items()}
    report = hybridgemm.patch(holder)
    assert report.fp8 == ["lm_head"] and type(holder.lm_head) is FP8HybridLinear, report
    sd = holder.state_dict()
    assert list(sd) == list(before) and name in {key.split(".")[-1] for key in sd}
    assert all(torch.equal(_bytes(v), before[key]) for key, v in sd.items())
    x = torch.randn(3, k).to(torch.bfloat16)
    ref = x.float() @ (lin.weight.float() * scale[:, None]).T + lin.bias.float()
    assert _rel(holder.lm_head(x).float(), ref) < 1e-2

"""perf/e2e_profile.py without a GPU: kernel names go to the right group, the per-group table
adds up, and the command refuses to run without CUDA."""

from __future__ import annotations

import pytest

from hybridgemm.perf import e2e_profile as ep


@pytest.mark.parametrize("name,group", [
    ("nvjet_sm90_tst_64x8_64x16_2x1_v_bz_TNT", "gemm"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float>", "gemm"),
    ("_glu_kernel", "gemm"),
    ("_splitk_kernel", "gemm"),
    ("_rms_norm_kernel", "norm"),
    ("_qk_norm_rope_store_kernel", "rotary"),
    ("_qk_rope_kernel", "rotary"),
    ("cudnn_generated_fort_native_sdpa_sm80_flash_fprop_wmma_f16", "attention"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "norm"),
    ("triton_poi_fused__unsafe_view_mul_silu_8", "activation"),
    ("triton_poi_fused__to_copy_mul_silu_0", "activation"),
    # Inductor's prologue of SDPA: rotary and casts, named after the attention op it feeds
    ("triton_poi_fused__scaled_dot_product_cudnn_attention__to_copy__unsafe_view_add_arange_bmm_cat_clone_cos_expand",
     "rotary"),
    ("triton_poi_fused__to_copy_add_arange_bmm_cat_cos_index_copy_mul_neg_sin_slice_split_with_sizes_transpose",
     "rotary"),
    ("triton_poi_fused_add_copy__16", "elementwise"),
    ("triton_red_fused_argmax_select_15", "other"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::rsqrt_kernel_cuda>", "norm"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, float>>>",
     "norm"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::pow_tensor_scalar_kernel_impl<float>>", "norm"),
    ("void at::native::elementwise_kernel<128, 4, at::native::neg_kernel_cuda>", "rotary"),
    ("void at::native::CatArrayBatchedCopy<at::native::OpaqueType<2u>, unsigned int, 4, 64, 64>", "rotary"),
    ("void at::native::index_elementwise_kernel<128, 4, at::native::index_copy_kernel_impl>", "kv_cache"),
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda>", "copy"),
    ("void at::native::vectorized_elementwise_kernel<8, at::native::bfloat16_copy_kernel_cuda>", "copy"),
    ("void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::BFloat16>>", "elementwise"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<c10::BFloat16, at::native::ArgMaxOps<float>>>",
     "other"),
    ("Memset (Device)", "other"),
    ("_moe_pair_down_kernel", "gemm"),
    ("_moe_pair_glu_kernel", "gemm"),
    ("_route_kernel", "routing"),
    ("void at::native::sbtopk::gatherTopK<float, unsigned int, 1, false>(at::cuda::detail::TensorInfo", "routing"),
    ("void at::native::bitonicSortKVInPlace<-2, -1, 16, 16, float, long, at::native::GTOp<float, true>>", "routing"),
    ("_quantize_token_kernel", "quantize"),
    ("_quantize_block_kernel", "quantize"),
    ("_dequantize_kernel", "quantize"),
    ("_layer_norm_kernel", "norm"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float, true>", "norm"),
    ("truncate_allocate_kernel", "elementwise"),  # no stray substring ("cat", "mean") makes it something else
])
def test_kernel_groups(name, group):
    assert ep.group_of(name) == group


def test_summary_adds_the_groups_per_variant():
    rows = [{"variant": v, "group": g, "us_per_token": us} for v, g, us in (
        ("stock", "gemm", 100.0), ("stock", "norm", 20.0), ("hybridgemm", "gemm", 90.0), ("hybridgemm", "norm", 5.0))]
    text = ep.summary(rows, floor_ms=0.06, layers=2)
    total = next(line for line in text.splitlines() if line.startswith("total")).split()
    assert [float(v) for v in total[1:]] == [120.0, 60.0, 95.0, 47.5]
    assert "stock 50.0%" in text and "hybridgemm 63.2%" in text
    prefill = ep.summary(rows, floor_ms=None, layers=2)  # prefill: no floor line, the GEMMs' sum kept
    assert "HBM floor" not in prefill and "stock 100.0 µs, hybridgemm 90.0 µs" in prefill


def test_needs_cuda(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert ep.main(["--model", "llama3-8b", "--layers", "1"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_kernel_times_by_grid_keys_each_launch_grid(monkeypatch):
    """``--by-grid``: the trace's kernel events summed per (name, grid); other events ignored."""
    import json

    events = [{"cat": "kernel", "name": "_splitk_kernel", "dur": 10.0, "args": {"grid": [144, 1, 1]}},
              {"cat": "kernel", "name": "_splitk_kernel", "dur": 12.0, "args": {"grid": [144, 1, 1]}},
              {"cat": "kernel", "name": "_splitk_kernel", "dur": 5.5, "args": {"grid": [48, 3, 1]}},
              {"cat": "kernel", "name": "idle", "dur": 0},
              {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "dur": 3.0}]

    class Prof:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def export_chrome_trace(self, path):
            with open(path, "w") as f:
                json.dump({"traceEvents": events}, f)

    monkeypatch.setattr(ep.torch.profiler, "profile", lambda **kw: Prof())
    monkeypatch.setattr(ep.torch.cuda, "synchronize", lambda: None)
    times = ep.kernel_times(lambda n: None, 2, by_grid=True)
    assert times == {"_splitk_kernel grid=144,1,1": (2, 22.0), "_splitk_kernel grid=48,3,1": (1, 5.5)}
    assert ep.group_of("_splitk_kernel grid=48,3,1") == "gemm"
    assert ep.parse_args(["--model", "llama3-8b", "--by-grid"]).by_grid


def test_fp8_options():
    args = ep.parse_args(["--model", "llama3-8b", "--weights", "fp8"])
    assert (args.weights, args.granularity) == ("fp8", "channel")
    assert ep.parse_args(["--model", "llama3-8b"]).granularity is None
    assert ep.parse_args(["--model", "llama3-8b", "--weights", "fp8", "--granularity", "block128"]).granularity \
        == "block128"
    assert ep.parse_args(["--model", "llama3-8b", "--weights", "fp8", "--quantize-lm-head"]).quantize_lm_head
    args = ep.parse_args(["--model", "llama3-8b", "--weights", "fp8", "--fp8-activations", "--modes", "prefill",
                          "--prefill", "333"])
    assert args.fp8_activations and args.modes == ["prefill"] and args.prefill == 333
    assert ep.parse_args(["--model", "llama3-8b"]).prefill == 2048
    assert ep.parse_args(["--model", "llama3-8b"]).modes == ["compiled_static", "eager_static"]  # prefill: asked for
    for argv in (["--granularity", "block128"], ["--quantize-lm-head"], ["--fp8-activations"],  # FP8 only
                 ["--prefill", "0"]):
        with pytest.raises(SystemExit) as info:
            ep.parse_args(["--model", "llama3-8b", *argv])
        assert info.value.code == 2

"""The read ceiling (perf/read_ceiling.py) and the layer-fusion bench's FP8 rows
(perf/bench_layer_fusion.py) without a GPU: FP8 bytes counted by hand, the one-buffer FP8
weight (what the GEMM and the reading kernel both read), the reading kernel under the Triton
interpreter (every element read once, whatever the grid), and the bench's options."""

from __future__ import annotations

import types

import pytest
import torch

from hybridgemm.kernels import fp8
from hybridgemm.perf import bench_layer_fusion as LF
from hybridgemm.perf import read_ceiling as R

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # without a GPU the kernel runs interpreted


@pytest.mark.parametrize("n, k, granularity, expected", [
    (4096, 4096, "channel", 4096 * 4096 + 4 * 4096),
    (4096, 4096, "block128", 4096 * 4096 + 4 * 32 * 32),
    (1000, 300, "block128", 1000 * 300 + 4 * 8 * 3),  # partial blocks count whole
    (6144, 4096, "channel", 6144 * 4096 + 4 * 6144),
])
def test_fp8_bytes_by_hand(n, k, granularity, expected):
    assert R.fp8_bytes(n, k, granularity) == expected


@pytest.mark.parametrize("granularity", fp8.GRANULARITIES)
def test_one_buffer_fp8_weight_is_the_quantized_weight_and_its_bytes(granularity):
    torch.manual_seed(0)
    w = torch.randn(384, 272, dtype=torch.bfloat16)  # 272: a partial K block
    q, buf = R.fp8_in_one_buffer(w, granularity)
    ref = fp8.quantize_fp8(w, granularity)
    assert buf.dtype == torch.uint8 and buf.numel() == R.fp8_bytes(384, 272, granularity) == q.nbytes
    assert torch.equal(q.data.view(torch.uint8), ref.data.view(torch.uint8)) and torch.equal(q.scale, ref.scale)
    # the weight lives in the buffer: data first, the scales right after it
    assert q.data.data_ptr() == buf.data_ptr() and q.scale.data_ptr() == buf.data_ptr() + 384 * 272
    buf[384 * 272:].view(torch.float32).mul_(2)
    assert torch.equal(q.dequantize(torch.float32), 2 * ref.dequantize(torch.float32))
    with pytest.raises(ValueError, match="not a multiple of 16"):
        R.fp8_in_one_buffer(torch.randn(3, 5), granularity)


def test_read_view_reads_bytes_four_at_a_time_where_it_can():
    assert R.read_view(torch.zeros(8, 4, dtype=torch.bfloat16)).dtype == torch.bfloat16
    assert R.read_view(torch.zeros(64, dtype=torch.uint8)).shape == (16,)
    assert R.read_view(torch.zeros(64, dtype=torch.uint8)).dtype == torch.int32
    assert R.read_view(torch.zeros(63, dtype=torch.uint8)).dtype == torch.uint8
    assert R.read_view(torch.zeros(8, 8, dtype=torch.float8_e4m3fn)).dtype == torch.int32


@pytest.mark.parametrize("buffer", [
    torch.arange(3 * R.READ_BLOCK + 77, dtype=torch.float32) % 251,  # not whole blocks
    (torch.arange(5 * R.READ_BLOCK + 8, dtype=torch.int32) % 97).view(torch.uint8),  # read as int32
    (torch.arange(R.READ_BLOCK + 3) % 200).to(torch.uint8),  # odd length: read as bytes
], ids=["fp32", "bytes-as-int32", "odd-bytes"])
def test_every_grid_reads_every_element_once(buffer, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(multi_processor_count=2))
    copies = [buffer.to(DEVICE), buffer.to(DEVICE) * 0]
    expected = R.read_view(copies[0]).double().sum().item()
    calls = R.read_calls(copies, DEVICE)
    assert len(calls) == len(R.READ_PROGRAMS_PER_SM)
    for call in calls:
        assert call(0).double().sum().item() == expected
        assert call(1).double().sum().item() == 0  # call(j) reads copy j
    with pytest.raises(ValueError, match="same number of elements"):
        R.read_calls([buffer, buffer[:-4]], DEVICE)


# ----------------------------------------------------------------------------- bench_layer_fusion's options


def test_layer_fusion_options():
    args = LF.parse_args([])
    assert args.granularity == ["channel", "block128"] and set(args.configs) == {"llama3-8b", "qwen2.5-7b"}
    assert LF.parse_args(["--no-fp8"]).granularity == []
    assert LF.parse_args(["--granularity", "block128", "block128"]).granularity == ["block128"]
    for bad in (["--m", "32"], ["--granularity", "tensor"], ["--model", "gpt-9"]):
        with pytest.raises(SystemExit) as exc:
            LF.parse_args(bad)
        assert exc.value.code == 2


def test_layer_fusion_without_gpu_exits_2(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exc:
        LF.main(["--model", "llama3-8b"])
    assert exc.value.code == 2 and "needs a CUDA GPU" in capsys.readouterr().err


def test_layer_fusion_lines_name_the_weights():
    bf16 = dict(model="llama3-8b", gemm="o", fused="residual", weights="bf16", m=1, plain_us=10.0, fused_us=10.5,
                cost_us=0.5, weight_mb=33.6, plain_tbps=3.36, read_us=9.0, plain_of_read=0.9)
    fp8_row = dict(bf16, fused="", weights="e4m3_channel", fused_us=None, cost_us=None, weight_mb=16.8)
    assert "+residual" in LF._line(bf16) and "10.00 ->   10.50 us (+0.50)" in LF._line(bf16)
    line = LF._line(fp8_row)
    assert "e4m3_channel" in line and "10.00 us; 16.8 MB" in line and "(90.0%)" in line
    untimed = dict(model="llama3-8b", gemm="qkv", fused="norm", weights="bf16", m=8, config="table: cublaslt")
    assert LF._line(untimed).endswith("M= 8: table: cublaslt")


# ----------------------------------------------------------------------------- the GPU's read rate (HBM floors)


@pytest.fixture
def fresh_rate(monkeypatch):
    monkeypatch.delenv(R.READ_TBPS_ENV)  # (tests/conftest.py pins it)
    R._cuda_read_tbps.cache_clear()
    yield
    R._cuda_read_tbps.cache_clear()


def test_the_test_suite_pins_the_read_rate():
    from hybridgemm.perf import bench_e2e as E

    assert R.device_read_tbps() == (4.23, R.READ_TBPS_ENV)
    assert E.hbm_floor_ms(4_230_000_000) == pytest.approx(1.0)


@pytest.mark.parametrize("value", ["0", "-1", "fast", "nan", "inf"])
def test_a_bad_pinned_read_rate_is_refused_by_name(value, monkeypatch):
    monkeypatch.setenv(R.READ_TBPS_ENV, value)
    with pytest.raises(ValueError, match=f"{R.READ_TBPS_ENV}=.*positive number"):
        R.device_read_tbps()


def test_a_pinned_read_rate_wins_on_any_device(fresh_rate, monkeypatch):
    monkeypatch.setenv(R.READ_TBPS_ENV, " 3.35 ")
    _fake_gpu(monkeypatch, "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(R, "_measure_read_tbps", lambda device: pytest.fail("a pinned rate is not measured"))
    assert R.device_read_tbps() == (3.35, R.READ_TBPS_ENV)


def _fake_gpu(monkeypatch, name: str):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: name)


def test_read_rate_without_a_gpu_is_the_h200_figure(fresh_rate, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    tbps, what = R.device_read_tbps()
    assert tbps == R.HBM_TBPS == 4.23 and "not a CUDA device" in what


def test_read_rate_of_an_h200_is_its_published_figure_unmeasured(fresh_rate, monkeypatch):
    _fake_gpu(monkeypatch, "NVIDIA H200")
    monkeypatch.setattr(R, "_measure_read_tbps", lambda device: pytest.fail("an H200 is not measured"))
    assert R.device_read_tbps() == (4.23, "the NVIDIA H200's measured read rate")


def test_read_rate_of_another_gpu_is_measured_once_and_floors_divide_by_it(fresh_rate, monkeypatch):
    from hybridgemm.perf import bench_e2e as E

    _fake_gpu(monkeypatch, "NVIDIA H100 80GB HBM3")
    measured = []
    monkeypatch.setattr(R, "_measure_read_tbps", lambda device: measured.append(device) or 3.0)
    assert R.device_read_tbps() == (3.0, "read rate measured on this NVIDIA H100 80GB HBM3")
    assert E.hbm_floor_ms(3 * 10**9) == pytest.approx(1.0)  # 3 GB at 3 TB/s
    assert E.hbm_floor_ms(3 * 10**9, tbps=1.5) == pytest.approx(2.0)
    assert "3.00 TB/s (read rate measured on this NVIDIA H100" in E.read_rate_note()
    assert R.device_read_tbps(0) == R.device_read_tbps("cuda:0") == R.device_read_tbps(torch.device("cuda"))
    assert measured == [torch.device("cuda", 0)]  # once per device and process, however it is named
    # a run on the CPU divides by the H200's figure, measuring nothing
    assert R.device_read_tbps("cpu")[0] == 4.23 and E.hbm_floor_ms(4_230_000_000, device="cpu") == pytest.approx(1.0)
    assert measured == [torch.device("cuda", 0)]


class _FakeEvent:
    clock = [0.0]

    def __init__(self, enable_timing=False):
        self.t = None

    def record(self):
        self.t = self.clock[0]

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return end.t - self.t


def test_measured_read_rate_is_the_fastest_grids_median(monkeypatch):
    # the reading calls advance a fake clock: grid i takes ms_of[i] (one slow outlier each);
    # the rate is the buffer's bytes over the fastest grid's median, timed after the first
    # grid has read for WARM_SECONDS (on a fake host clock that ticks 10 ms a reading)
    monkeypatch.setattr(R, "MEASURE_BYTES", 1 << 20)
    monkeypatch.setattr(R, "WARM_SECONDS", 0.05)
    ticks = iter(range(10**6))
    monkeypatch.setattr(R, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks) * 0.01))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (8 << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "device", lambda device: __import__("contextlib").nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    ms_of = [0.5, 0.25, 0.4, 0.3]
    seen, calls_made = [], [0] * len(ms_of)

    def read_calls(buffers, device):
        seen.append(buffers[0].numel() * buffers[0].element_size())

        def make(i, ms):
            def call(j):
                calls_made[i] += 1
                # one slow call of the five timed (the first grid's falls in its warm-up)
                _FakeEvent.clock[0] += ms * (9 if calls_made[i] == 3 else 1)
            return call
        return [make(i, ms) for i, ms in enumerate(ms_of)]

    monkeypatch.setattr(R, "read_calls", read_calls)
    tbps = R._measure_read_tbps(torch.device("cpu"))
    assert seen == [1 << 20]
    # compile + 5 timed each; the first grid also read while the clock went 0.01 .. 0.04 (4 reads)
    assert calls_made == [10, 6, 6, 6]
    assert tbps == pytest.approx((1 << 20) / 0.25e-3 / 1e12)
    # a quarter of the free memory bounds the buffer where it is less
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (1 << 20, 80 << 30))
    R._measure_read_tbps(torch.device("cpu"))
    assert seen[-1] == (1 << 18) // (4 * R.READ_BLOCK) * (4 * R.READ_BLOCK)


def test_too_little_free_memory_to_measure_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (1000, 80 << 30))
    with pytest.raises(RuntimeError, match="too little free memory.*HYBRIDGEMM_READ_TBPS"):
        R._measure_read_tbps(torch.device("cpu"))

"""Table keys, M ranges and layout classes (autotune_cache/keys.py): the exact boundaries and
the messages, pure CPU. The basic round trips are in tests/autotune_cache/test_table.py."""

import math
import random

import numpy as np
import pytest
import torch

from hybridgemm.autotune_cache.keys import (
    ShapeKey,
    TableError,
    TableKey,
    layout_class,
    octave,
    sample_points,
    split_range,
    validation_points,
)
from hybridgemm.kernels.epilogue import Activation, Epilogue
from hybridgemm.kernels.problem import Problem


def problem(m=16, n=64, k=32, dtype=torch.bfloat16, **kw):
    kw.setdefault("ldx", k)
    kw.setdefault("ldw", k)
    kw.setdefault("ldo", n)
    return Problem(m=m, n=n, k=k, dtype=dtype, epilogue=Epilogue(Activation.NONE, False), **kw)


def key_text(op="linear", dtype="bf16", epi="bias", n="N=64", k="K=32", m="M=9-16", layout="c"):
    return "|".join((op, dtype, epi, n, k, m, layout))


# ---------------------------------------------------------------- validation points


@pytest.mark.parametrize("lo, hi", [(1, 1), (3, 4), (5, 8), (9, 16), (17, 32), (1, 24), (10, 33)])
def test_validation_points_of_a_narrow_range_are_every_other_m(lo, hi):
    # up to 2 * 12 = 24 Ms wide: every M of the range that sample_points does not time
    assert validation_points(lo, hi) == [m for m in range(lo, hi + 1) if m not in sample_points(lo, hi)]


@pytest.mark.parametrize("lo, hi", [(1, 25), (33, 64), (257, 512), (4097, 8192), (8193, 16384), (1, 16384)])
def test_validation_points_of_a_wide_range_are_log_spaced_inside_it(lo, hi):
    got = validation_points(lo, hi)
    # 12 interior points of the geometric sequence from lo to hi, rounded and kept strictly
    # inside the range; the ones sample_points already times are not repeated.
    expect = {min(max(int(round(v)), lo + 1), hi - 1) for v in np.geomspace(lo, hi, 14)[1:-1]}
    assert got == sorted(expect - set(sample_points(lo, hi)))
    assert all(lo < m < hi for m in got) and len(got) <= 12


def test_validation_points_width_boundary_and_count():
    assert len(validation_points(1, 24)) == 24 - len(sample_points(1, 24))  # 24 wide: every M
    assert len(validation_points(1, 25)) <= 12  # 25 wide: log-spaced
    # count sets both: up to 2 * count wide every M, else count log-spaced ones
    assert validation_points(1, 4, count=2) == [3]  # 4 wide: every M but sampled 1, 2, 4
    assert validation_points(1, 8, count=2) == [2, 4]  # 8 > 4 wide: 1 * 2, 1 * 4 (step 8^(1/3)); 3 is sampled
    wide = validation_points(8193, 16384, count=4)
    expect = {round(v) for v in np.geomspace(8193, 16384, 6)[1:-1]}
    assert wide == sorted(expect - set(sample_points(8193, 16384)))


# ---------------------------------------------------------------- octaves, halves


def test_octave_of_one_and_two():
    assert octave(1) == (1, 1) and octave(2) == (2, 2) and octave(3) == (3, 4)


@pytest.mark.parametrize("m", [1, 2, 3, 7, 64, 65, 1000, 16384])
def test_octave_holds_m_and_its_low_edge_follows_the_previous_octave(m):
    lo, hi = octave(m)
    assert lo <= m <= hi and hi & (hi - 1) == 0
    if m > 1:
        assert octave(lo - 1)[1] == lo - 1  # the ranges tile 1..M_MAX


def test_check_m_message_names_the_type():
    with pytest.raises(TypeError, match="m must be an int, got float"):
        octave(2.0)
    with pytest.raises(TypeError, match="got bool"):
        octave(True)


@pytest.mark.parametrize("lo, hi", [(1, 8), (9, 16), (100, 107), (257, 512), (5000, 16384)])
def test_split_range_halves_tile_the_range(lo, hi):
    (a, b), (c, d) = split_range(lo, hi)
    assert a == lo and d == hi and c == b + 1 and lo <= b < hi
    assert b == round(math.sqrt(lo * hi))  # the geometric middle (inside the range at these widths)


# ---------------------------------------------------------------- layout classes


def _reference_layout(p):
    """The definition, computed independently: the largest power of two up to 16 dividing
    every pointer alignment and every row stride in bytes; ``s`` when any row stride is
    wider than its row."""
    e = p.dtype.itemsize
    values = (p.align_x, p.align_w, p.align_out, p.align_bias, p.ldx * e, p.ldw * e, p.ldo * e)
    a = max(q for q in (1, 2, 4, 8, 16) if all(v % q == 0 for v in values))
    dense = p.ldx == p.k and p.ldw == p.k and p.ldo == p.n
    return ("c" if a == 16 else f"a{a}") if dense else f"s{a}"


def test_layout_class_matches_its_definition_on_random_problems():
    rng = random.Random(1234)
    seen = set()
    for _ in range(400):
        dtype = rng.choice([torch.float16, torch.bfloat16, torch.float32])
        n, k = (rng.choice([rng.randint(1, 70), 8 * rng.randint(1, 9)]) for _ in range(2))
        kw = {f"align_{name}": rng.choice([1, 2, 4, 8, 16, 256, 256, 256, 256]) for name in ("x", "w", "out", "bias")}
        p = problem(n=n, k=k, dtype=dtype, ldx=k + rng.choice([0, 0, 0, 1, 8]), ldw=k + rng.choice([0, 0, 0, 3]),
                    ldo=n + rng.choice([0, 0, 0, 2]), **kw)
        got = layout_class(p)
        assert got == _reference_layout(p), p
        TableKey("linear", "bf16", "none", 1, 1, 1, 1, got)  # always a class a key accepts
        seen.add(got)
    assert {"c", "a1", "a2", "a4", "a8", "s1", "s2", "s16"} <= seen


def test_layout_class_ignores_zero_row_strides():
    # K = 0 (an empty problem): a zero stride is divisible by everything and says nothing
    assert layout_class(problem(k=0)) == "c"
    assert layout_class(problem(n=8, k=0, align_x=4)) == "a4"


def test_shape_key_from_problem_keeps_layout_and_dtype():
    strided = problem(ldx=40)
    assert ShapeKey.from_problem(strided).layout == "s16"
    assert TableKey.from_problem(strided).to_string().endswith("|s16")
    assert ShapeKey.from_problem(problem(align_x=2)).layout == "a2"
    # tf32 is a flag of fp32 problems only: a 16-bit problem keeps its dtype whatever it says
    assert ShapeKey.from_problem(problem(dtype=torch.bfloat16, tf32=True)).dtype == "bf16"
    assert ShapeKey.from_problem(problem(dtype=torch.float16, tf32=True)).dtype == "fp16"
    assert ShapeKey.from_problem(problem(dtype=torch.float32, tf32=False)).dtype == "fp32"
    assert ShapeKey.from_problem(problem(dtype=torch.float32, tf32=True)).dtype == "tf32"
    assert TableKey.for_range(ShapeKey("linear", "fp16", "none", 8, 8, "a4"), 1, 1).layout == "a4"


# ---------------------------------------------------------------- keys: fields and messages


@pytest.mark.parametrize("field, value, match", [
    ("op", "Linear", "bad op 'Linear'"), ("op", 7, "bad op 7"),
    ("dtype", "int8", "bad dtype 'int8'; expected one of bf16, fp16, fp32, tf32"),
    ("epilogue", "gelu+bias", "bad epilogue 'gelu\\+bias'"),
    ("n", 0, "bad N 0"), ("k", 0, "bad K 0"), ("n", -1, "bad N -1"), ("k", 2**31, f"bad K {2**31}"),
    ("n", 4.0, "bad N 4.0"), ("k", True, "bad K True"),
    ("layout", "a16", "bad layout class 'a16'"), ("layout", "s32", "bad layout class"),
])
def test_table_key_fields_are_checked_with_messages(field, value, match):
    fields = dict(op="linear", dtype="bf16", epilogue="bias", n=64, k=32, m_lo=9, m_hi=16, layout="c")
    fields[field] = value
    with pytest.raises(TableError, match=f"^{match}"):
        TableKey(**fields)


def test_n_and_k_bounds_are_exact():
    TableKey("linear", "bf16", "bias", 1, 2**31 - 1, 1, 1, "c")  # both edges of 0 < v < 2**31
    assert TableKey.from_string(key_text(n="N=1", k="K=2147483647")).k == 2**31 - 1
    with pytest.raises(TableError, match="bad K 2147483648"):
        TableKey.from_string(key_text(k="K=2147483648"))


def test_key_length_limit_is_200_characters():
    base = key_text(op="")
    ok = key_text(op="a" * (199 - len(base)))
    assert len(ok) == 199 and TableKey.from_string(ok).op == "a" * (199 - len(base))
    too_long = key_text(op="a" * (200 - len(base)))
    assert len(too_long) == 200
    with pytest.raises(TableError, match="bad key"):
        TableKey.from_string(too_long)
    v1 = key_text(m="M=16")
    ok1 = key_text(op="a" * (199 - len(v1) + len("linear")), m="M=16")
    assert len(ok1) == 199 and TableKey.from_v1_string(ok1).m_lo == 16
    with pytest.raises(TableError, match="bad key"):
        TableKey.from_v1_string(key_text(op="a" * (200 - len(v1) + len("linear")), m="M=16"))


@pytest.mark.parametrize("parse", [TableKey.from_string, TableKey.from_v1_string])
@pytest.mark.parametrize("text", [None, 16, b"linear|bf16|bias|N=64|K=32|M=9-16|c",
                                  ["linear", "bf16", "bias", "N=64", "K=32", "M=9-16", "c"]])
def test_a_key_that_is_not_a_string_is_a_table_error(parse, text):
    with pytest.raises(TableError, match="bad key"):
        parse(text)


def test_key_messages_name_the_key_and_what_was_expected():
    with pytest.raises(TableError, match=r"^bad key 'linear\|bf16': expected op\|dtype\|epilogue\|N=\|K=\|M=lo-hi"):
        TableKey.from_string("linear|bf16")
    with pytest.raises(TableError, match=r"^bad key 'linear\|bf16': expected op\|dtype\|epilogue\|N=\|K=\|M=\|layout"):
        TableKey.from_v1_string("linear|bf16")
    bad_n = key_text(n="N=0x40")
    with pytest.raises(TableError, match=r"^bad key 'linear\|bf16\|bias\|N=0x40\|.*': expected N=<positive int>"):
        TableKey.from_string(bad_n)
    with pytest.raises(TableError, match=r"^bad key .*K=3\.5.*: expected K=<positive int>"):
        TableKey.from_v1_string(key_text(k="K=3.5", m="M=16"))
    with pytest.raises(TableError, match=r"^bad key .*: expected M=<lo>-<hi>"):
        TableKey.from_string(key_text(m="M=9"))


@pytest.mark.parametrize("field", ["Q=9-16", "m=9-16", "9-16", "MM9-16", "=M9-16"])
def test_the_range_field_must_be_labelled_m(field):
    with pytest.raises(TableError, match="expected M=<lo>-<hi>"):
        TableKey.from_string(key_text(m=field))


@pytest.mark.parametrize("n, k", [("K=64", "N=32"), ("N=64", "N=32"), ("n=64", "K=32"), ("N=", "K=32")])
def test_n_and_k_fields_must_be_labelled(n, k):
    with pytest.raises(TableError, match="expected [NK]=<positive int>"):
        TableKey.from_string(key_text(n=n, k=k))
    with pytest.raises(TableError, match="expected [NK]=<positive int>"):
        TableKey.from_v1_string(key_text(n=n, k=k, m="M=16"))

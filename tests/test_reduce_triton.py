"""The fused Triton reduction (``hookcli.engine.reduce_triton``) against plain float64 torch.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``, which
tests/conftest.py sets before Triton is imported); with CUDA the same tests run on the GPU. The interpreter runs programs one after
another in numpy, about 25 ms per block of 4096 values, so the sizes drawn stay small but cross every
path: one program (one launch), several programs and the merge launch, the multi-tensor table. The
kernels are also compiled for sm_80 and sm_90 (to PTX and a cubin, no GPU needed; in a fresh interpreter,
as Triton compiles nothing once imported for interpreting), which checks what the interpreter does not:
types, loop-carried values, int64 offsets.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hookcli.engine import stats
from hookcli.engine.stats import merge, to_host
from reference import hard_cases, aten_op_counts, assert_moments_match
from test_stats_properties import planted, tensors
from timeouts import scaled_timeout

triton = pytest.importorskip("triton", reason="Triton is not installed")
from hookcli.engine import reduce_triton  # noqa: E402  (after the skip)
from hookcli.engine.reduce_triton import (  # noqa: E402
    BLOCK,
    SINGLE_BLOCKS,
    available,
    norms,
    reduce_moments,
    reduce_moments_many,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FAST_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

pytestmark = pytest.mark.skipif(not available(torch.zeros(1, device=DEVICE)),
                                reason="Triton runs neither on a GPU here nor in its interpreter")


def host(vector: torch.Tensor) -> list[float]:
    assert vector.dtype == torch.float64 and vector.shape == (stats.SCALE + 1,)
    return to_host([vector])[0]


def test_available_says_which_tensors_it_takes() -> None:
    assert available(torch.zeros(3, device=DEVICE))
    assert not available(torch.zeros(3, dtype=torch.int64, device=DEVICE))
    assert not available(torch.zeros(3).to_sparse())
    assert available(torch.zeros(3)) == reduce_triton.INTERPRETED
    assert reduce_triton.unavailable(DEVICE) is None
    assert reduce_triton.unavailable("mps") == "Triton does not run on mps tensors"
    assert (reduce_triton.unavailable("cuda") is None) == (DEVICE == "cuda")
    other = "cuda" if DEVICE == "cpu" else "cpu"  # the kernels run on one of the two per process
    if other == "cpu" or torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="cannot run here"):
            reduce_moments(torch.zeros(3, device=other))
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="one device"):
            reduce_moments_many([torch.zeros(2, device="cuda"), torch.zeros(2)])


@pytest.mark.parametrize("n", [1, 5, BLOCK, BLOCK + 1, BLOCK * SINGLE_BLOCKS + 1, 60_000])
@pytest.mark.parametrize("dtype", FAST_DTYPES)
def test_sizes_around_the_block_and_program_boundaries_equal_float64_torch(n: int, dtype: torch.dtype) -> None:
    """One block, a partial block, one program walking several blocks, several programs and a merge."""
    x = (torch.randn(n, generator=torch.Generator().manual_seed(n), dtype=torch.float64) * 3 + 1).to(dtype)
    x = x.to(DEVICE)
    assert_moments_match(host(reduce_moments(x)), x)
    assert host(reduce_moments(x, zeros=False))[stats.ZEROS] == 0.0


def test_a_million_values_offset_from_zero() -> None:
    """The largest fixed case (about 6 s in the interpreter): 245 blocks over four programs and a merge."""
    x = (torch.randn(10**6, generator=torch.Generator().manual_seed(6)) * 0.01 + 1.0).to(DEVICE)
    assert_moments_match(host(reduce_moments(x)), x)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_any_tensor_any_layout_equals_float64_torch(data: st.DataObject) -> None:
    """Hypothesis' tensors of ``test_stats_properties``: float16/bfloat16/float32/float64, zero-size to ~10^5
    values, transposed, permuted, channels-last, expanded, stepped slices, storage offsets with NaN
    around, the lazy negative bit; NaN, +-Inf, -0.0 planted; offsets and scales from 1e-30 to 1e30."""
    t = data.draw(tensors()).to(DEVICE)
    zeros = data.draw(st.booleans())
    assert_moments_match(host(reduce_moments(t, zeros=zeros)), t, zeros=zeros)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the interpreter's numpy, on purpose
@pytest.mark.parametrize("dtype", FAST_DTYPES)
def test_extreme_values_denormals_constants_and_nonfinite(dtype: torch.dtype) -> None:
    info = torch.finfo(dtype)
    cases = {
        "near the limit, both signs": torch.tensor([info.max, -info.max, info.max * 0.5, -info.max], dtype=dtype),
        **hard_cases(dtype),
    }
    for name, x in cases.items():
        x = x.to(DEVICE)
        values = host(reduce_moments(x))
        assert_moments_match(values, x), name
    assert host(reduce_moments(torch.empty(0, device=DEVICE))) == list(stats.empty_vector(torch.device("cpu")))


def test_layouts_are_read_in_place_and_expanded_tensors_without_their_repeats() -> None:
    g = torch.Generator().manual_seed(1)
    base = torch.randn(8, 16, 12, 12, generator=g)
    cases = [base.t() if base.dim() == 2 else base.transpose(1, 3), base.contiguous(memory_format=torch.channels_last),
             base.permute(3, 1, 0, 2), base[:, :, ::2], base[:, :1].expand(8, 40, 12, 12),
             torch.randn(3, 1, generator=g).expand(3, 5000), base.bfloat16().transpose(0, 2)]
    for t in cases:
        t = t.to(DEVICE)
        assert_moments_match(host(reduce_moments(t)), t)
    # a dense permuted layout is read where it lies: no copy, unlike the gapped slice
    dense = base.contiguous(memory_format=torch.channels_last).to(DEVICE)
    assert "aten.clone" not in aten_op_counts(lambda: reduce_triton._readable(dense))
    assert "aten.clone" in aten_op_counts(lambda: reduce_triton._readable(base[:, :, ::2].to(DEVICE)))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_merging_two_vectors_equals_the_vector_of_their_concatenation(data: st.DataObject) -> None:
    """``stats.merge`` of two vectors from the kernel is the concatenation's statistics (as float64 torch)."""
    dtype = data.draw(st.sampled_from(FAST_DTYPES))
    a = planted(data.draw, dtype, [data.draw(st.integers(0, 9000))]).to(DEVICE)
    b = planted(data.draw, dtype, [data.draw(st.integers(0, 300))]).to(DEVICE)
    merged = merge(reduce_moments(a), reduce_moments(b))
    assert_moments_match(to_host([merged])[0], torch.cat([a, b]), merged=True)


def test_many_tensors_in_one_call_equal_each_alone() -> None:
    """A step's parameters: mixed dtypes and sizes (empty, scalar, expanded, one with NaN), one row each."""
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(300, 70, generator=g), torch.randn(5, generator=g).bfloat16(), torch.empty(0),
          torch.tensor(2.5), torch.randn(20_000, generator=g) * 1e3, torch.randn(4, 1, generator=g).expand(4, 9),
          torch.tensor([1.0, math.nan, -math.inf]), torch.randn(64, 3, generator=g).t(),
          torch.randn(7, generator=g, dtype=torch.float64)]
    xs = [x.to(DEVICE) for x in xs]
    rows = reduce_moments_many(xs, zeros=True)
    assert rows.shape == (len(xs), stats.SCALE + 1)
    for x, values in zip(xs, to_host(list(rows))):
        assert_moments_match(values, x)


def test_norms_are_one_op_for_all_tensors() -> None:
    xs = [torch.randn(40, 3).to(DEVICE), torch.randn(7).bfloat16().to(DEVICE)]
    got = norms(xs)
    for x, norm in zip(xs, got):
        assert float(norm) == pytest.approx(float(torch.linalg.vector_norm(x.double())), rel=1e-6)
    assert sum(aten_op_counts(lambda: norms(xs)).values()) == 1 + len(xs)  # _foreach_norm, and each detach


def test_one_op_per_tensor_and_one_for_a_whole_step() -> None:
    """As torch sees it (a dispatch mode): the custom op is one op, whatever it launches; every
    parameter of a model in one call is one op too."""
    x = torch.randn(5000, 3).to(DEVICE)
    assert aten_op_counts(lambda: reduce_moments(x)) == {"hookcli.reduce_moments": 1}
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 2)).to(DEVICE)
    params = list(model.parameters())
    counts = aten_op_counts(lambda: (reduce_moments_many(params), norms(params)))
    assert counts["hookcli.reduce_moments_many"] == 1 and counts["aten._foreach_norm"] == 1
    assert sum(n for op, n in counts.items() if op != "aten.detach") <= 3


class Probed(torch.nn.Module):
    """A model whose forward reduces its hidden activation with the custom op."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(6, 32), torch.nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.a(x))
        return self.b(h), reduce_moments(h, zeros=True)


def test_torch_compile_traces_the_op_without_a_graph_break() -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = Probed().to(DEVICE)
    x = torch.randn(10, 6).to(DEVICE)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    out, vector = compiled(x)
    assert not counters["graph_break"], dict(counters["graph_break"])
    h = torch.relu(model.a(x)).detach()
    assert torch.equal(out, model(x)[0])
    assert_moments_match(host(vector), h)


COMPILE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from hookcli.engine import reduce_triton as rt

arch, dtype = int(sys.argv[1]), sys.argv[2]
tl = triton.language
partials = rt._kernel(rt._partials_kernel, False)
signature = {"x_ptr": "*" + dtype, "table_ptr": "*i64", "out_ptr": "*fp64", "n_arg": "i32", "repeats_arg": "i32",
             "G": "i32"}
element = {"bf16": tl.bfloat16, "fp64": tl.float64, "fp32": tl.float32}[dtype]
constants = {"TINY": 1e-38, "TABLE": arch == 90, "DTYPE": element,
             "WIDE": tl.float64 if dtype == "fp64" else tl.float32, "BLOCK": rt.BLOCK, "ZEROS": True,
             "FINAL": arch == 80}
signature.update({name: "constexpr" for name in constants})
target = GPUTarget("cuda", arch, 32)
kernel = triton.compile(triton.compiler.ASTSource(partials, signature, constants), target=target,
                        options={"num_warps": 8})
assert "cubin" in kernel.asm and ".visible .entry _partials_kernel" in kernel.asm["ptx"]
merge = rt._kernel(rt._merge_kernel, False)
signature = {"part_ptr": "*fp64", "out_ptr": "*fp64", "table_ptr": "*i64", "G": "i32", "repeats_arg": "i32",
             "TABLE": "constexpr", "PARTS": "constexpr"}
kernel = triton.compile(triton.compiler.ASTSource(merge, signature, {"TABLE": arch == 90, "PARTS": 512}),
                        target=target)
assert "cubin" in kernel.asm
histogram = rt._kernel(rt._histogram_kernel, False)
signature = {"table_ptr": "*i64", "bounds_ptr": "*fp64", "out_ptr": "*i32", "G": "i32", "DTYPE": "constexpr",
             "BLOCK": "constexpr", "BINS": "constexpr", "SLOTS": "constexpr"}
kernel = triton.compile(triton.compiler.ASTSource(histogram, signature, {"DTYPE": element, "BLOCK": rt.BLOCK,
                                                                         "BINS": 30, "SLOTS": 32}), target=target)
assert "cubin" in kernel.asm
print("compiled")
"""


@pytest.mark.parametrize(("arch", "dtype"), [(80, "bf16"), (90, "bf16"), (90, "fp64")])
def test_the_kernels_compile_for_cuda_without_a_gpu(arch: int, dtype: str) -> None:
    """The interpreter runs Python; this compiles the real thing (Triton's front end, LLVM, ptxas): one
    program per tensor and a single tensor (sm_80), the table of many tensors and partials (sm_90)."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", COMPILE, str(arch), dtype], capture_output=True, text=True, env=env,
                          timeout=scaled_timeout(300), check=False)
    assert done.returncode == 0 and done.stdout.strip() == "compiled", done.stderr[-3000:]


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's numpy: inf / inf
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_histograms_of_many_tensors_equal_stats_histogram_of_each(data: st.DataObject) -> None:
    """The bucket counts exactly as ``stats.histogram`` (the per-tensor function, tested against torch.histc
    in tests/test_watch_tensorboard.py) computes them, NaN/Inf cases included; min, max and the count
    exactly; the sum and the sum of squares to float32 accuracy of the data (float64 torch here)."""
    from hypothesis import assume

    ts = [data.draw(tensors()) for _ in range(data.draw(st.integers(1, 3)))]
    ts = [t.to(DEVICE) for t in ts if t.numel() and t.dtype != torch.float64]
    assume(ts)
    got = reduce_triton.histograms(ts)
    assert got.shape == (len(ts), 5 + stats.HISTOGRAM_BINS)
    for t, row in zip(ts, got.cpu()):
        ref = stats.histogram(t).cpu()
        assert torch.equal(row[5:], ref[5:]), (row[5:], ref[5:])
        assert torch.equal(row[:3], ref[:3]) or (row[:2].isnan().all() and ref[:2].isnan().all()), (row, ref)
        values = t.detach().to("cpu", torch.float64).reshape(-1)
        finite = values[torch.isfinite(values)]
        for got_value, exact, size in ((float(row[3]), float(values.sum()), float(finite.abs().sum())),
                                       (float(row[4]), float(values.square().sum()), float(finite.square().sum()))):
            assert (got_value == exact or (math.isnan(got_value) and math.isnan(exact))
                    or abs(got_value - exact) <= 1e-6 * size), (got_value, exact)


def test_histograms_take_the_same_ops_for_one_tensor_as_for_twelve() -> None:
    """O(1): the launches (views, which launch nothing, apart) do not grow with the number of tensors."""
    def compute_ops(k: int) -> int:
        ps = [torch.randn(5, 4).to(DEVICE) for _ in range(k)]
        reduce_triton.histograms(ps)  # the address table is built (and cached) once
        with_views = aten_op_counts(lambda: reduce_triton.histograms(ps))
        views = {"aten.select", "aten.slice", "aten.view", "aten.detach", "aten.as_strided", "aten.unbind"}
        return sum(n for op, n in with_views.items() if op not in views)

    assert compute_ops(1) == compute_ops(12)

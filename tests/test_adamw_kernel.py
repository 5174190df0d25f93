"""The CPU tier's one-pass AdamW kernel (tiertrain/update/adamw_kernel.c through
update/native_adamw.py): torch AdamW's update within fp32 rounding of a float64 oracle, its
compute copy bit for bit torch's own cast, the same bits in place or into second buffers, over
any length, thread split and alignment; built once per host, refused by name where it cannot be.
"""
from __future__ import annotations

import math
import shlex
import shutil

import pytest
import torch

from tiertrain.update import host_adamw, native_adamw

LR, BETA1, BETA2, EPS, DECAY, STEP, CLIP = 1e-3, 0.9, 0.999, 1e-8, 0.1, 3, 0.5


def _state(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g), torch.randn(n, generator=g), torch.randn(n, generator=g) * 0.1,
            torch.rand(n, generator=g) * 0.01]


def _hyper():
    return host_adamw.hyperparameters(LR, BETA1, BETA2, EPS, DECAY, STEP, CLIP)


def _oracle(p, g, m, v):
    """torch.optim.AdamW's formula in float64 (decoupled decay, bias corrections)."""
    p, g, m, v = (t.double() for t in (p, g, m, v))
    g = g * CLIP
    m = BETA1 * m + (1 - BETA1) * g
    v = BETA2 * v + (1 - BETA2) * g * g
    denom = v.sqrt() / math.sqrt(1 - BETA2 ** STEP) + EPS
    return p * (1 - LR * DECAY) - LR / (1 - BETA1 ** STEP) * m / denom, m, v


@pytest.mark.parametrize("n", [1, 31, 1000, (1 << 16) + 7, (1 << 20) + 13])
def test_the_update_is_torch_adamw_within_fp32_rounding(n):
    state = _state(n)
    p64, m64, v64 = _oracle(*state)
    p, g, m, v = (t.clone() for t in state)
    host_adamw._kernels(None)(p, g, m, v, _hyper())
    # A handful of fp32 operations per element, each rounding by at most 2^-24 relative: the
    # bound is 16 such roundings of the largest terms (the decayed master; the step).
    step = LR / (1 - BETA1 ** STEP) * (m64.abs() / (v64.sqrt() / math.sqrt(1 - BETA2 ** STEP) + EPS))
    bound = 16 * 2.0 ** -24 * (p64.abs() + step)
    assert ((p.double() - p64).abs() <= bound).all()
    assert ((m.double() - m64).abs() <= 8 * 2.0 ** -24 * (m64.abs() + state[1].abs().double())).all()
    assert ((v.double() - v64).abs() <= 8 * 2.0 ** -24 * v64.abs()).all()
    assert torch.equal(g, state[1]), "the gradient is read, never written"


@pytest.mark.parametrize("n", [5, 4099, (1 << 20) + 13])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, None])
@pytest.mark.parametrize("offset", [0, 3], ids=["outputs aligned: streamed", "outputs unaligned: stored"])
def test_into_second_buffers_gives_the_in_place_bits_and_keeps_the_inputs(n, dtype, offset):
    state = _state(n, seed=1)
    in_place = [t.clone() for t in state]
    copy = [] if dtype is None else [torch.empty(n, dtype=dtype)]
    host_adamw._kernels(dtype)(*in_place, *copy, _hyper())
    inputs = [t.clone() for t in state]
    outs = [torch.empty(n + offset)[offset:] for _ in range(3)]
    copy_into = [] if dtype is None else [torch.empty(n, dtype=dtype)]
    host_adamw._kernels(dtype, into=True)(*inputs, *outs, *copy_into, _hyper())
    for kept, old in zip([inputs[0], inputs[2], inputs[3]], [state[0], state[2], state[3]]):
        assert torch.equal(kept, old)
    assert torch.equal(outs[0], in_place[0]) and torch.equal(outs[1], in_place[2]) and torch.equal(outs[2], in_place[3])
    if dtype is not None:
        assert torch.equal(copy_into[0], copy[0])
        assert torch.equal(copy[0], in_place[0].to(dtype))


def _edge_values():
    tiny = torch.tensor([1e-45, -1e-45, 1e-40, 1.17e-38, 1.18e-38, 5.96e-8, 2.98e-8, 2.99e-8, 6.1e-5, 6.11e-5])
    large = torch.tensor([65504.0, 65519.99, 65520.0, -65520.0, 3.3895e38, -3.4e38, 1e30])
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf")])
    g = torch.Generator().manual_seed(2)
    spread = torch.cat([torch.randn(20_000, generator=g) * 10.0 ** e for e in range(-44, 39, 4)])
    return torch.cat([tiny, large, special, spread, -spread])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("offset", [0, 1, 17])
def test_the_compute_copy_is_torchs_own_cast_bit_for_bit(dtype, offset):
    """Round to nearest even, subnormals, overflow to infinity and signed zeros as torch's .to()
    does, whatever the destination's alignment (the vector stores start at a 64-byte boundary)."""
    values = _edge_values()
    n = values.numel()
    zeros = torch.zeros(n)
    outs = [torch.empty(n) for _ in range(3)]
    copy = torch.empty(n + offset, dtype=dtype)[offset:]
    lr_zero = host_adamw.hyperparameters(0.0, BETA1, BETA2, EPS, 0.0, 1, 1.0)  # (the master unchanged)
    host_adamw._kernels(dtype, into=True)(values.clone(), zeros, zeros, zeros, *outs, copy, lr_zero)
    assert torch.equal(outs[0], values)
    expected = values.to(dtype)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    wrong = copy.view(bits) != expected.view(bits)
    assert not wrong.any(), (values[wrong][:5], dtype)


def test_a_nan_master_gives_a_nan_copy():
    values = torch.tensor([float("nan"), 1.0] * 40)
    for dtype in (torch.bfloat16, torch.float16):
        copy = torch.empty(80, dtype=dtype)
        host_adamw._kernels(dtype)(values.clone(), torch.zeros(80), torch.zeros(80), torch.zeros(80), copy,
                                   host_adamw.hyperparameters(0.0, BETA1, BETA2, EPS, 0.0, 1, 1.0))
        assert torch.isnan(copy[::2]).all() and (copy[1::2] == 1).all()


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_every_thread_split_gives_the_same_bits(threads):
    n = (1 << 18) + 5
    state = _state(n, seed=3)
    results = []
    before = torch.get_num_threads()
    try:
        for t in (1, threads):
            torch.set_num_threads(t)
            p, g, m, v = (x.clone() for x in state)
            copy = torch.empty(n, dtype=torch.bfloat16)
            host_adamw._kernels(torch.bfloat16)(p, g, m, v, copy, _hyper())
            results.append((p, m, v, copy))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_tensors_the_kernel_cannot_step_are_refused_by_name():
    p, g, m, v = _state(64)
    kernel = host_adamw._kernels(torch.bfloat16)
    with pytest.raises(ValueError, match=r"contiguous torch.float32 tensors of 64 elements .*got torch.float64"):
        kernel(p, g.double(), m, v, torch.empty(64, dtype=torch.bfloat16), _hyper())
    with pytest.raises(ValueError, match=r"torch.bfloat16 tensors of 64 elements .*got torch.bfloat16 \(32,\)"):
        kernel(p, g, m, v, torch.empty(64, dtype=torch.bfloat16)[::2], _hyper())
    with pytest.raises(ValueError, match="not contiguous"):
        kernel(p, torch.empty(128)[::2], m, v, torch.empty(64, dtype=torch.bfloat16), _hyper())
    with pytest.raises(ValueError, match=r"takes 8 hyperparameters \(decay, 1 - beta1, .*gradient factor\); got 7"):
        kernel(p, g, m, v, torch.empty(64, dtype=torch.bfloat16), _hyper()[:7])
    with pytest.raises(ValueError, match="compute copies in bf16, fp16 or fp32, not torch.float64"):
        native_adamw.Kernel(host_adamw._library(), torch.float64, into=False)


def test_the_library_is_built_once_per_host_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("TIERTRAIN_CACHE_DIR", str(tmp_path))
    native_adamw.build()
    (cached,) = (tmp_path / "kernels").iterdir()
    built_at = cached.stat().st_mtime_ns
    calls = []
    real_run = native_adamw.subprocess.run
    monkeypatch.setattr(native_adamw.subprocess, "run",
                        lambda args, **kw: calls.append(args) or real_run(args, **kw))
    native_adamw.build()
    assert [c[1] for c in calls] == ["--version"], "a cached library is loaded, not compiled again"
    assert cached.stat().st_mtime_ns == built_at


def _compiler_script(tmp_path, monkeypatch, name, body):
    """$CC set to a shell script of this body; the kernel cache in an empty directory."""
    script = tmp_path / name
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    monkeypatch.setenv("CC", str(script))
    monkeypatch.setenv("TIERTRAIN_CACHE_DIR", str(tmp_path / "cache"))


def test_a_compiler_that_fails_is_named_with_its_error(tmp_path, monkeypatch):
    _compiler_script(tmp_path, monkeypatch, "broken-cc", "[ \"$1\" = --version ] && { echo broken 1.0; exit 0; }\n"
                                                         "echo 'no such flag' >&2\nexit 3")
    with pytest.raises(native_adamw.KernelUnavailable,
                       match=r"broken-cc failed to build adamw_kernel.c \(exit 3\): no such flag"):
        native_adamw.build()


def test_cc_may_be_a_command_line_with_arguments(tmp_path, monkeypatch):
    """$CC as build systems set it ("ccache gcc", "gcc -m64"): split as a shell splits it."""
    real = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    _compiler_script(tmp_path, monkeypatch, "wrapper", f'[ "$1" = --wrapped ] || {{ echo "$1" >&2; exit 9; }}\n'
                                                       f'shift\nexec {shlex.quote(real)} "$@"')
    monkeypatch.setenv("CC", f"{shlex.quote(str(tmp_path / 'wrapper'))} --wrapped")
    native_adamw.Kernel(native_adamw.build(), torch.bfloat16, into=True)
    monkeypatch.setenv("CC", "gcc 'unclosed")
    with pytest.raises(native_adamw.KernelUnavailable, match=r"\$CC=\"gcc 'unclosed\" is not a command line"):
        native_adamw.build()


@pytest.mark.skipif(__import__("platform").machine() != "x86_64", reason="x86-64 instruction-set levels")
@pytest.mark.parametrize("arch", ["x86-64", "x86-64-v3"], ids=["SSE2", "AVX2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("offset", [0, 3], ids=["aligned: outputs streamed", "copy unaligned"])
def test_every_instruction_set_gives_the_same_bits(arch, dtype, offset, tmp_path, monkeypatch):
    """The library built for this host's vectors and one built for an older x86-64 level (the
    generic loop, no AVX-512 stores) update and round alike, at any alignment of the copy."""
    monkeypatch.setenv("TIERTRAIN_CACHE_DIR", str(tmp_path))
    generic = native_adamw.Kernel(native_adamw.build(arch), dtype, into=True)
    values = _edge_values()
    n = values.numel()
    state = [values] + [t[:n] for t in _state(n, seed=4)[1:]]
    state[3] = state[3].abs()
    results = []
    for kernel in (host_adamw._kernels(dtype, into=True), generic):
        outs = [torch.empty(n) for _ in range(3)]
        copy = torch.empty(n + offset, dtype=dtype)[offset:]
        kernel(*state, *outs, copy, _hyper())
        results.append([*outs, copy])
    for native, other in zip(*results):
        assert torch.equal(native.view(torch.int32 if native.dtype == torch.float32 else torch.int16),
                           other.view(torch.int32 if other.dtype == torch.float32 else torch.int16))


def test_a_compiler_without_openmp_builds_a_one_thread_kernel_and_says_so(tmp_path, monkeypatch):
    real, threaded = native_adamw._compiler(), host_adamw._kernels(torch.bfloat16)  # (built before $CC changes)
    _compiler_script(tmp_path, monkeypatch, "cc-without-openmp",
                     "for a in \"$@\"; do\n  [ \"$a\" = -fopenmp ] && "
                     "{ echo 'unsupported option -fopenmp' >&2; exit 1; }\n"
                     f"done\nexec {shlex.join(real)} \"$@\"")
    with pytest.warns(RuntimeWarning, match="built without OpenMP .*unsupported option -fopenmp.*: it runs on one "
                                            "thread"):
        serial = native_adamw.Kernel(native_adamw.build(), torch.bfloat16, into=False)
    n = (1 << 18) + 5
    results = []
    for kernel in (serial, threaded):
        p, g, m, v = _state(n, seed=5)
        copy = torch.empty(n, dtype=torch.bfloat16)
        kernel(p, g, m, v, copy, _hyper())
        results.append((p, m, v, copy))
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_a_cached_library_that_does_not_load_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("TIERTRAIN_CACHE_DIR", str(tmp_path / "first"))
    native_adamw.build()
    (good,) = (tmp_path / "first" / "kernels").iterdir()
    broken = tmp_path / "second" / "kernels" / good.name  # (the same key, a path this process never loaded)
    broken.parent.mkdir(parents=True)
    broken.write_bytes(b"not a shared library")
    monkeypatch.setenv("TIERTRAIN_CACHE_DIR", str(tmp_path / "second"))
    with pytest.warns(RuntimeWarning, match=f"built without OpenMP \\(the built kernel {broken} does not load .*"
                                            f"delete it to build it again\\)"):
        native_adamw.build()

"""Guards for the private PyTorch behaviour tiertrain still relies on, because no public API
gives it. Each test fails when that behaviour changes, naming the code that depends on it:

* the fused CPU AdamW kernel's split of a tensor into whole SIMD vectors from its start and a
  scalar tail (rounded differently) — ``tiertrain/update/nvme/plan.py`` cuts chunks only
  at multiples of ``ALIGN_ELEMS`` from a parameter piece's start so that updating the pieces
  of a chunk is bit for bit the update of the whole piece (``chunk_update.ChunkUpdate``);
* ``Tensor._base`` telling views from tensors that own their storage —
  ``tiertrain.pipeline.executor.release_output`` frees only the latter;
* ``torch._dynamo`` being the module that building a torch optimizer imports lazily —
  ``tiertrain.launch.launch_local`` imports it once before forking the ranks;
* ``torch.compile(module)`` returning ``torch._dynamo.eval_frame.OptimizedModule`` with the
  module in ``_orig_mod`` and its settings in ``dynamo_ctx``, and ``Module.compile()`` setting
  ``_compiled_call_impl`` — ``tiertrain/compiling.py`` takes the wrapper apart (the model keeps
  its names) and refuses ``.compile()`` above checkpointed blocks.

``backward_from`` (pipeline executor) used the private ``Variable._execution_engine``; it now
uses the public ``torch.autograd.backward`` on ``torch.autograd.graph.get_gradient_edge``, and
is tested with the pipeline (tests/test_pipeline.py).
"""
from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys

import pytest
import torch
from torch.optim.adamw import adamw

from tiertrain.update.nvme.plan import ALIGN_ELEMS, _plan
from tiertrain.pipeline import backward_from, release_output

# ---------------------------------------------------------------------------------------------
# Fused CPU AdamW: results on a tensor equal those on its pieces cut at multiples of ALIGN_ELEMS
# ---------------------------------------------------------------------------------------------
# (step, lr, weight_decay): first and later steps, small and large lr, with and without decay.
CONFIGS = list(itertools.product([1, 2, 50], [1e-3, 0.37], [0.0, 0.1]))
N = 20011                                 # not a multiple of any vector width: a scalar tail


def _state(seed: int, n: int = N):
    """(param, grad, exp_avg, exp_avg_sq) with gradients over 11 orders of magnitude, so that
    a different rounding of any element shows in the result."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-8, 3, n)[torch.randperm(n, generator=g)]
    return (torch.randn(n, generator=g), torch.randn(n, generator=g) * scale,
            torch.randn(n, generator=g) * 0.01, torch.rand(n, generator=g) * 0.01)


def _fused(p, g, m, v, ranges, step, lr, wd):
    """torch's fused AdamW, as the library calls it, on the pieces ``ranges`` of the tensors."""
    adamw([p[a:b] for a, b in ranges], [g[a:b] for a, b in ranges], [m[a:b] for a, b in ranges],
          [v[a:b] for a, b in ranges], [], [torch.tensor(float(step - 1)) for _ in ranges],
          fused=True, amsgrad=False, beta1=0.9, beta2=0.95, lr=lr, weight_decay=wd, eps=1e-8,
          maximize=False)


def _updated(state, cuts, step, lr, wd):
    p, g, m, v = (t.clone() for t in state)
    bounds = [0, *cuts, p.numel()]
    with torch.no_grad():
        _fused(p, g, m, v, list(zip(bounds[:-1], bounds[1:])), step, lr, wd)
    return p, m, v


def _differing(a, b) -> int:
    """Elements whose bits differ, over (param, exp_avg, exp_avg_sq)."""
    return sum(int((x.view(torch.int32) != y.view(torch.int32)).sum()) for x, y in zip(a, b))


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    """The kernel splits work between threads in cache-line units: check with 1 and 2."""
    n = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(n)


def test_fused_adamw_is_bit_exact_on_pieces_cut_at_align_elems(threads):
    """NVMeAdamW relies on this: a piece cut at multiples of ALIGN_ELEMS from its start updates
    bit for bit as the uncut piece. Cuts every ALIGN_ELEMS elements (the finest the library
    makes) and at scattered multiples of it."""
    rng = torch.Generator().manual_seed(1)
    grid = range(ALIGN_ELEMS, N, ALIGN_ELEMS)
    scattered = sorted(int(k) * ALIGN_ELEMS for k in
                       torch.randperm(len(grid), generator=rng)[:40] + 1)
    for (step, lr, wd), cuts in itertools.product(CONFIGS, [list(grid), scattered]):
        state = _state(step)
        whole = _updated(state, [], step, lr, wd)
        pieces = _updated(state, cuts, step, lr, wd)
        assert _differing(whole, pieces) == 0, (
            f"torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}, {threads} "
            f"thread(s)): fused AdamW on a tensor cut at multiples of ALIGN_ELEMS={ALIGN_ELEMS} no "
            f"longer equals the uncut update (step={step}, lr={lr}, weight_decay={wd}). The kernel's "
            "vector/scalar split changed: NVMeAdamW's chunk cuts (plan._plan) no longer "
            "keep its step bit-exact; find the kernel's new unit and raise ALIGN_ELEMS to a "
            "multiple of it.")


def test_fused_adamw_is_bit_exact_on_the_chunks_nvme_adamw_plans(threads):
    """The same through the library's own cutting: plan._plan cuts a shard of
    several pieces into small chunks, and each chunk's pieces are updated as ChunkUpdate does
    (one fused call per weight-decay group); the result equals one fused call per whole piece,
    as torch.optim.AdamW(fused=True) makes it in memory."""
    pieces = [(0, 17, 0.0), (17, 10017, 0.1), (10017, 10017, 0.1), (10020, 20000, 0.0)]
    for step, lr, _ in CONFIGS:
        state = _state(100 + step)
        ref = tuple(t.clone() for t in state)
        with torch.no_grad():
            for a, b, wd in pieces:
                if b > a:
                    _fused(ref[0], ref[1], ref[2], ref[3], [(a, b)], step, lr, wd)
        for cap in (ALIGN_ELEMS, 5 * ALIGN_ELEMS, 64 * ALIGN_ELEMS):
            p, g, m, v = (t.clone() for t in state)
            for ch in _plan(0, N, pieces, cap):
                with torch.no_grad():
                    for wd, ranges in ch.groups:
                        _fused(p, g, m, v, [(ch.lo + a, ch.lo + b) for a, b in ranges], step, lr, wd)
            assert _differing((ref[0], ref[2], ref[3]), (p, m, v)) == 0, (
                f"chunks of {cap} elements (step={step}, lr={lr}): NVMeAdamW's chunked update "
                "differs from the whole-piece fused AdamW; see the message of the test above.")


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() == "DEFAULT",
                    reason="ATen's DEFAULT kernels emulate vectors with scalar code: no tail effect")
def test_fused_adamw_rounds_its_scalar_tail_differently():
    """Why the cuts must be aligned, and proof that the inputs above reach the scalar tail:
    cuts every 37 elements (off the vector grid) change some elements' bits. If this fails, the
    kernel's tail now rounds like its vector body: nothing breaks, but ALIGN_ELEMS is then no
    longer needed, and update/nvme/plan.py's docstring should say so."""
    cuts = list(range(37, N, 37))
    changed = sum(_differing(_updated(_state(step), [], step, lr, wd),
                             _updated(_state(step), cuts, step, lr, wd))
                  for step, lr, wd in CONFIGS)
    assert changed > 0


# ---------------------------------------------------------------------------------------------
# Tensor._base: None for a tensor that owns its storage, the root base for a view
# ---------------------------------------------------------------------------------------------
def test_base_tells_views_from_tensors_owning_storage():
    """release_output frees an output's storage only when ``_base is None``. A view's ``_base``
    must be the tensor owning the storage (for a view of a view too); an op's fresh result,
    including a copy made by reshape/contiguous, must have none."""
    w = torch.randn(4, 4, requires_grad=True)
    y = torch.tanh(torch.randn(3, 4) @ w) * 2            # what a stage returns: a fresh result
    assert y._base is None and w._base is None
    for view in (y.view(12), y.view(3, 2, 2), y[1:], y.t(), y.unsqueeze(0), y.reshape(12),
                 y.view(12).view(4, 3), y.narrow(1, 0, 2)):
        assert view._base is y, "a view's _base is no longer the tensor owning its storage"
    for fresh in (y + 0, y.t().contiguous(), y.t().reshape(12), y.clone()):
        assert fresh._base is None, "a tensor owning its storage now reports a _base"

    views = [y.view(12), y[1:]]
    assert [release_output(t) for t in views] == [0, 0] and [t.numel() for t in views] == [12, 8]
    grad_fn = y.grad_fn
    assert release_output(y) == 12 * 4 and y.numel() == 1 and y._base is None
    assert y.grad_fn is grad_fn, "replacing .data no longer keeps the output's grad_fn"
    backward_from(y, torch.ones(3, 4))
    assert w.grad is not None and w.grad.shape == (4, 4)


# ---------------------------------------------------------------------------------------------
# torch._dynamo: what building an optimizer imports, so launch_local preloads it
# ---------------------------------------------------------------------------------------------
_DYNAMO_PROBE = """
import json, sys
import torch
after_torch = "torch._dynamo" in sys.modules
from tiertrain.config import OptimizerConfig
from tiertrain.optim import build_adamw
build_adamw([{"params": [torch.nn.Parameter(torch.zeros(4))]}], OptimizerConfig())
print(json.dumps({"after_torch": after_torch, "after_optimizer": "torch._dynamo" in sys.modules}))
"""


def test_building_an_optimizer_imports_torch_dynamo():
    """launch_local imports torch._dynamo before forking (and lists it in the forkserver
    preload) because every rank would otherwise import it when it builds its optimizer. Fails
    if the module is gone, if torch stops importing it there (the preload is then dead weight),
    or if ``import torch`` imports it already (the preload is then redundant)."""
    import torch._dynamo  # noqa: F401  (the name launch_local imports and preloads)

    out = subprocess.run([sys.executable, "-c", _DYNAMO_PROBE], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert not seen["after_torch"], "import torch now imports torch._dynamo: drop launch_local's preload"
    assert seen["after_optimizer"], ("building a torch optimizer no longer imports torch._dynamo: "
                                     "drop launch_local's preload of it")


# ---------------------------------------------------------------------------------------------
# torch.compile's module wrapper and Module.compile(): what tiertrain/compiling.py takes apart
# ---------------------------------------------------------------------------------------------
def test_a_compiled_module_wrapper_and_module_compile_keep_what_compiling_reads():
    """tiertrain.compiling.unwrap_compiled replaces a ``torch.compile(module)`` wrapper by the
    module, its forward compiled by the wrapper's ``dynamo_ctx``; compile_checkpointed_block
    refuses a module whose ``.compile()`` left ``_compiled_call_impl``. Fails if the wrapper
    stops being ``torch._dynamo.eval_frame.OptimizedModule`` with the module in ``_orig_mod``, if
    ``dynamo_ctx`` no longer compiles a function with the wrapper's backend, or if ``.compile()``
    stops setting ``_compiled_call_impl``."""
    from torch._dynamo.eval_frame import OptimizedModule

    from tiertrain.compiling import unwrap_compiled

    graphs = []

    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    module = torch.nn.Linear(3, 3)
    wrapper = torch.compile(module, backend=backend)
    assert isinstance(wrapper, OptimizedModule) and wrapper._orig_mod is module
    compiled = wrapper.dynamo_ctx(lambda x: torch.relu(x) * 2)
    assert torch.equal(compiled(torch.ones(2)), torch.full((2,), 2.0)) and len(graphs) == 1
    assert unwrap_compiled(wrapper) is module and "forward" in module.__dict__
    module(torch.ones(3))
    assert len(graphs) == 2, "the wrapper's settings no longer compile the unwrapped module's forward"
    other = torch.nn.Linear(3, 3)
    assert getattr(other, "_compiled_call_impl", None) is None
    other.compile(backend=backend)
    assert other._compiled_call_impl is not None, "Module.compile() no longer sets _compiled_call_impl"

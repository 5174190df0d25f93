"""The compiled CPU-tier step (optimizer.impl=compiled, tiertrain/update/host_adamw.py): AdamW,
the clip factor and the copy into the compute shards in one pass, trains like single-process
PyTorch, keeps torch's optimizer state, and is refused or replaced by name where it cannot run.

The tiny GPT's pieces are far below the size the pass takes by default (SMALL_PIECE), so the
runs here lower that threshold to 0: every piece goes through the compiled kernel.
"""
from __future__ import annotations

import pytest
import torch

import tiertrain
from reference import Oracle, engine_train, global_batches, make_config, make_model, reference_train
from tiertrain.optim import squared_norm
from tiertrain.testing import run_distributed
from tiertrain.update import host_adamw, native_adamw

STEPS = 4
MICRO = 2
PLACEMENTS = {"stage 2, optimizer on CPU": {"stage": 2, "offload_optimizer": "cpu"},
              "stage 3, both on CPU": {"stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"}}


def _config(zero, dtype="fp32", impl="compiled", clip=0.05, accum=1):
    # clip 0.05 is below these runs' gradient norm (~1.5): the clip factor really scales.
    return make_config(zero={**zero, "bucket_mb": 0.02},
                       batch={"micro_batch_size": MICRO, "grad_accum_steps": accum}, precision={"dtype": dtype},
                       optimizer={"eps": 1e-3, "lr": 1e-2, "grad_clip": clip, "impl": impl})


def _train(rank, world, zero, dtype, impl, accum):
    host_adamw.SMALL_PIECE = 0
    cfg = _config(zero, dtype, impl, accum=accum)
    losses, params, engine = engine_train(rank, world, make_model(), cfg, global_batches(STEPS, MICRO * accum * world))
    pass_used = engine.update.host_pass is not None
    # Every compute shard holds its master rounded to the compute dtype: the pass wrote it.
    shards_match = all(torch.equal(u.shard[:u.master.numel()], u.master.to(u.shard.dtype))
                       for u in engine.flat.units if u.master is not u.shard)
    return losses, params, pass_used, shards_match


@pytest.mark.timeout(120)
@pytest.mark.parametrize("placement", [pytest.param(name, marks=pytest.mark.slow) if "stage 2" in name else name
                                       for name in PLACEMENTS])
@pytest.mark.parametrize("accum", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_compiled_step_matches_single_process_reference(placement, accum):
    zero = PLACEMENTS[placement]
    losses, params, pass_used, shards_match = run_distributed(_train, 2, zero, "fp32", "compiled", accum,
                                                              timeout=110)[0]
    assert pass_used
    assert shards_match
    oracle = Oracle.run(reference_train, make_model(), _config(zero, accum=accum),
                        global_batches(STEPS, MICRO * accum * 2))
    assert oracle.losses64[-1] < oracle.losses64[0], "the reference itself must learn"
    oracle.check(losses, params, f"compiled CPU-tier step, {placement}, accum {accum}")


@pytest.mark.timeout(120)
def test_bf16_compute_shards_are_written_by_the_pass_and_track_the_fused_step():
    zero = PLACEMENTS["stage 3, both on CPU"]
    compiled = run_distributed(_train, 2, zero, "bf16", "compiled", 1, timeout=110)[0]
    fused = run_distributed(_train, 2, zero, "bf16", "fused", 1, timeout=110)[0]
    assert compiled[2] and not fused[2]
    assert compiled[3], "a bf16 compute shard is not its master rounded to bf16"
    # Both update the same fp32 masters from the same bf16 gradients; they differ by the
    # rounding of two kernels (a few fp32 ulps), which bf16 forwards can pass on at 2^-8.
    for name, value in compiled[1].items():
        assert torch.allclose(value, fused[1][name], rtol=0, atol=4e-3 * float(fused[1][name].abs().max())), name
    assert max(abs(a - b) / b for a, b in zip(compiled[0], fused[0])) < 1e-3


def _one_rank_engine(impl, model=None, **opt):
    cfg = make_config(zero={"stage": 2, "offload_optimizer": "cpu"}, batch={"micro_batch_size": MICRO},
                      optimizer={"impl": impl, **opt})
    return tiertrain.wrap(model or make_model(), cfg, tiertrain.Topology.build(cfg.parallel))


def test_the_state_is_torch_adamw_state_so_checkpoints_interchange(monkeypatch):
    monkeypatch.setattr(host_adamw, "SMALL_PIECE", 0)
    states = {}
    for impl in ("compiled", "fused"):
        engine = _one_rank_engine(impl)
        for batch in global_batches(2, MICRO):
            engine.train_batch(iter([batch]))
        states[impl] = engine.update.optimizer.state_dict()
    compiled, fused = states["compiled"], states["fused"]
    assert compiled["param_groups"] == fused["param_groups"]
    assert compiled["state"].keys() == fused["state"].keys()
    for key, state in compiled["state"].items():
        assert state.keys() == fused["state"][key].keys()
        assert state["step"].dtype == fused["state"][key]["step"].dtype and float(state["step"]) == 2
        for moment in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(state[moment], fused["state"][key][moment], rtol=1e-4, atol=1e-9)


def test_auto_takes_the_pass_on_the_cpu_tier_only():
    assert _one_rank_engine("auto").update.host_pass is not None
    cfg = make_config(zero={"stage": 2}, optimizer={"impl": "auto"})
    on_device = tiertrain.wrap(make_model(), cfg, tiertrain.Topology.build(cfg.parallel))
    assert on_device.update.host_pass is None


def test_a_client_optimizer_with_impl_compiled_is_refused_by_name():
    model = make_model()
    cfg = make_config(zero={"stage": 2, "offload_optimizer": "cpu"}, optimizer={"impl": "compiled"})
    with pytest.raises(ValueError, match="optimizer.impl=compiled is the default AdamW's kernel"):
        tiertrain.wrap(model, cfg, tiertrain.Topology.build(cfg.parallel),
                       optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def test_without_a_compiler_compiled_raises_and_auto_says_it_falls_back(monkeypatch):
    monkeypatch.setattr(native_adamw.shutil, "which", lambda name: None)
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(host_adamw, "_library", host_adamw._library.__wrapped__)  # (no library loaded)
    monkeypatch.setattr(host_adamw, "_kernels", host_adamw._kernels.__wrapped__)
    with pytest.raises(host_adamw.KernelUnavailable, match="no C compiler"):
        _one_rank_engine("compiled")
    with pytest.warns(RuntimeWarning, match="compiled CPU-tier AdamW is not available"):
        engine = _one_rank_engine("auto")
    assert engine.update.host_pass is None


def test_squared_norm_is_one_accurate_pass():
    g = torch.Generator().manual_seed(0)
    grad = torch.randn(3_000_017, generator=g) * 1e-3 + 2e-3  # (a mean: a plain fp32 sum drifts)
    exact = float(grad.double().pow(2).sum())
    assert abs(float(squared_norm(grad)) / exact - 1) < 1e-6
    assert float(squared_norm(torch.zeros(0))) == 0.0
    small = torch.randn(100, generator=g)
    assert float(squared_norm(small)) == float(small.pow(2).sum())


def test_on_the_cpu_tier_each_units_norm_is_taken_during_backward_and_equals_the_device_tiers(tmp_path):
    from tiertrain.observe.trace import StepTrace, load_spans

    norms = {}
    for tier in ("cpu", "none"):
        cfg = make_config(zero={"stage": 2, "offload_optimizer": tier, "bucket_mb": 0.02},
                          batch={"micro_batch_size": MICRO}, optimizer={"grad_clip": 0.05})
        engine = tiertrain.wrap(make_model(), cfg, tiertrain.Topology.build(cfg.parallel))
        units = len(engine.flat.units)
        batches = iter(global_batches(2, MICRO))
        engine.train_batch(batches)
        trace = StepTrace(str(tmp_path / f"{tier}.json"), steps=1, first_step=1)
        trace.before_step(1)
        engine.train_batch(batches)
        trace.after_step(1)
        norms[tier] = engine.last_grad_norm
        spans = load_spans(trace.path)
        (backward,) = [s for s in spans if s.name == "backward"]
        during = [s for s in spans if s.name == "grad_norm_at_landing"
                  and s.start_s + s.duration_s <= backward.start_s + backward.duration_s]
        if tier == "cpu":  # (all but the last reductions in flight, max_in_flight = 2, land in backward)
            assert units > 4 and len(during) >= units - 2
        else:
            assert not during
    assert norms["cpu"] == norms["none"]


@pytest.mark.parametrize("into", [False, True], ids=["in place", "into second buffers"])
def test_the_kernel_runs_without_the_gil(into):
    """A thread running the kernel leaves the GIL to the others (a ctypes call releases it):
    the overlapped step's worker must not stall backward's Python hooks for a whole update.
    While a thread makes calls, the main thread's Python keeps running, many times per call
    (held, it would run only between calls)."""
    import threading
    import time

    n = 1 << 24
    tensors = [torch.rand(n) for _ in range(7 if into else 4)]
    out = torch.empty(n, dtype=torch.bfloat16)
    hyper = host_adamw.hyperparameters(1e-3, 0.9, 0.999, 1e-8, 0.0, 1, 1.0)
    kernel = host_adamw._kernels(torch.bfloat16, into=into)
    kernel(*tensors, out, hyper)
    calls = 8
    start = time.perf_counter()
    for _ in range(calls):
        kernel(*tensors, out, hyper)
    call_s = (time.perf_counter() - start) / calls
    running = threading.Event()

    def run():
        running.set()
        for _ in range(calls):
            kernel(*tensors, out, hyper)
    worker = threading.Thread(target=run)
    worker.start()
    running.wait()
    pauses, last = [], time.perf_counter()
    while worker.is_alive():
        now = time.perf_counter()
        pauses.append(now - last)
        last = now
        time.sleep(1e-4)
    worker.join()
    assert len(pauses) > 8 * calls, (call_s, len(pauses))


def _llama():
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32))


def _llama_batches():
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 128, (MICRO * 2, 16), generator=g) for _ in range(STEPS)]
    return [{"input_ids": x, "labels": x.clone()} for x in ids]  # (the user's convention: labels = inputs)


def _train_llama(rank, world):
    host_adamw.SMALL_PIECE = 0
    losses, params, engine = engine_train(rank, world, _llama(), _config(PLACEMENTS["stage 3, both on CPU"]),
                                          _llama_batches())
    return losses, params, engine.update.host_pass is not None


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_hugging_face_llama_trains_with_the_compiled_step_like_single_process():
    losses, params, pass_used = run_distributed(_train_llama, 2, timeout=110)[0]
    assert pass_used
    oracle = Oracle.run(reference_train, _llama(), _config(PLACEMENTS["stage 3, both on CPU"]), _llama_batches())
    assert oracle.losses64[-1] < oracle.losses64[0], "the reference itself must learn"
    oracle.check(losses, params, "compiled CPU-tier step, Hugging Face Llama, stage 3 both on CPU")

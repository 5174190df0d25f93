"""A user's own loop that bypasses the engine's backward fails by name; one that forgets its
step is warned; a model changed behind the engine's back (converted, unfrozen) fails by name.

``loss.backward()`` where ``engine.backward(loss)`` belongs (what an FSDP or DDP user types)
used to do nothing visible: the gradients went through the engine's hooks unscaled and
uncounted, ``engine.step()`` returned False (no accumulation boundary was reached) and the
model never trained. Now the first gradient to reach a parameter outside ``engine.backward``
raises an error naming it and the call to make, and leaves nothing behind: the run then trains
exactly as one that never made the mistake. A backward past the end of an accumulation window
without ``engine.step()`` (a loop that forgot it) accumulated into the next
window without a word: it now warns, once. ``model.half()`` (or ``.to(dtype or device)``) after
wrap() gave the parameters memory of their own at stages 0-2, so the forward went on with the
weights of that moment and the updates reached nothing; a parameter unfrozen after wrap() got
gradients nothing read. Both are refused by name at the next forward (stage 3 refuses the
conversion as it happens).
"""
from __future__ import annotations

import warnings

import pytest
import torch

import tiertrain
from tiertrain.config import ConfigError
from reference import global_batches, make_config, make_model

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("one_torch_thread")]

BYPASS = r"outside engine\.backward\(loss\)"


def _run(stage: int, mistake):
    """Two steps of two micro-batches each; mistake(engine, model, micro) runs first if given.
    Returns the error the mistake raised and the trained parameters."""
    cfg = make_config(zero={"stage": stage}, batch={"micro_batch_size": 2, "grad_accum_steps": 2})
    model = make_model()
    engine = tiertrain.wrap(model, cfg, tiertrain.Topology.build(cfg.parallel))
    batches = global_batches(2, 4)
    error = None
    if mistake is not None:
        with pytest.raises(RuntimeError, match=BYPASS) as raised:
            mistake(engine, model, {k: v[:2] for k, v in batches[0].items()})
        error = str(raised.value)
    for batch in batches:
        for j in range(2):
            engine.backward(engine({k: v[2 * j: 2 * j + 2] for k, v in batch.items()}))
        assert engine.step(), "the step after the refused backward updates"
    params = engine.full_state_dict()
    engine.close()
    return error, params


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_loss_backward_instead_of_engine_backward_is_refused_and_leaves_nothing_behind(stage):
    clean = _run(stage, None)[1]
    error, params = _run(stage, lambda engine, model, micro: engine(micro).backward())
    assert "a gradient reached parameter 'norm.weight'" in error and "call loss = engine(batch) and " \
                                                                    "engine.backward(loss)" in error, error
    assert all(torch.equal(params[n], clean[n]) for n in clean), "the refused backward changed the training"


def test_a_backward_of_the_model_called_directly_is_refused_too():
    """At stages 0-2 (stage 3 refuses it already: its units are released after such a forward)."""
    clean = _run(2, None)[1]
    error, params = _run(2, lambda engine, model, micro: model(**micro).backward())
    assert "model(x) rather than engine(batch)" in error, error
    assert all(torch.equal(params[n], clean[n]) for n in clean)


@pytest.mark.parametrize("accum", [1, 2])
def test_a_backward_past_a_window_without_step_warns_once_and_the_gradients_add_up(accum):
    """A loop that forgot engine.step() after a window never updated, without a word.
    A warning, not an error: several losses' backwards before one step (grad_accum_steps=1,
    engine.backward(loss1), engine.backward(loss2), engine.step()) add up on purpose, as in
    torch. Their sum is what step() applies: with one micro-batch per step, two backwards of the
    loss update exactly as one backward of twice the loss."""
    cfg = make_config(zero={"stage": 2}, batch={"micro_batch_size": 2, "grad_accum_steps": accum})
    batch = global_batches(1, 2 * accum)[0]
    micro = [{k: v[2 * j: 2 * j + 2] for k, v in batch.items()} for j in range(accum)]
    runs = {}
    for twice in (False, True):
        model = make_model()
        engine = tiertrain.wrap(model, cfg, tiertrain.Topology.build(cfg.parallel))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for m in micro:
                engine.backward(engine(m) * (1 if twice else 2))
            if twice:  # a loop that forgot engine.step() after the window
                for m in micro:
                    engine.backward(engine(m))
        warned = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        if twice:
            assert len(warned) == 1 and (f"accumulation window (batch.grad_accum_steps={accum}: micro-batch {accum} "
                                         f"ended it) without engine.step() since") in warned[0], warned
        else:
            assert not warned, warned
        assert engine.step()
        runs[twice] = engine.full_state_dict()
        engine.close()
    if accum == 1:  # g + g against the backward of 2·loss, 2·g: both exact, so bit for bit
        assert all(torch.equal(runs[True][n], runs[False][n]) for n in runs[False])


def _after_one_step(stage: int, model=None):
    """(model, engine, the next batch): the model wrapped at stage and trained one step."""
    config = make_config(zero={"stage": stage}, batch={"micro_batch_size": 2})
    model = make_model() if model is None else model
    engine = tiertrain.wrap(model, config, tiertrain.Topology.build(config.parallel))
    batches = global_batches(2, 2)
    engine.backward(engine(batches[0]))
    engine.step()
    return model, engine, batches[1]


@pytest.mark.parametrize("stage", [0, 2, 3])
@pytest.mark.parametrize("conversion", ["half", "half then float"])
def test_a_model_converted_after_wrap_is_refused_and_close_hands_back_the_trained_model(stage, conversion):
    model, engine, batch = _after_one_step(stage)
    trained = engine.full_state_dict()
    if stage == 3:  # (refused as it happens: the released parameters are not read)
        with pytest.raises(tiertrain.ReleasedParameterError, match=r"half\(\) read parameter 'embed.weight'.* If "
                                                                   r"that was model.half\(\) or model.to\(...\) of "
                                                                   r"the wrapped model: the engine owns"):
            model.half()
    else:
        model.half()
        if conversion == "half then float":
            model.float()
        with pytest.raises(ConfigError, match=r"parameter 'embed.weight' of a wrapped model was (converted to "
                                              r"torch.float16 on cpu from the engine's torch.float32|given memory of "
                                              r"its own)"):
            engine(batch)
    engine.close()
    assert all(torch.equal(p.detach(), trained[n]) for n, p in model.named_parameters()), \
        "close() hands back the trained values"


@pytest.mark.parametrize("stage", [0, 3])
def test_a_parameter_unfrozen_after_wrap_is_refused_by_name(stage):
    model = make_model()
    model.blocks[0].mlp.fc1.weight.requires_grad_(False)
    model, engine, batch = _after_one_step(stage, model)
    model.blocks[0].mlp.fc1.weight.requires_grad_(True)
    with pytest.raises(ConfigError, match=r"parameter 'blocks.0.mlp.fc1.weight' was frozen \(requires_grad=False\) "
                                          r"when the model was wrapped and requires grad now.* in a param group of "
                                          r"their own with lr 0"):
        engine(batch)
    engine.close()


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_module_replaced_after_wrap_is_refused_by_name(stage):
    """model.norm = nn.LayerNorm(...) after wrap(): the engine's parameters left the forward and
    the new ones trained nothing (their gradients piled up in .grad). Refused at the next forward."""
    model, engine, batch = _after_one_step(stage)
    model.norm = torch.nn.LayerNorm(32)
    with pytest.raises(ConfigError, match=r"parameters 'norm.bias', 'norm.weight' of the wrapped model are no longer "
                                          r"in the model: their module was replaced after wrap\(\) \(model.x = "
                                          r"nn.Linear\(...\)\), and parameters 'norm.weight', 'norm.bias' joined it"):
        engine(batch)
    with pytest.raises(ConfigError, match=r"no longer in the model"):  # (a loop that caught it is refused again)
        engine(batch)
    engine.close()


class _LazyScale(torch.nn.Module):
    """A gain built at its first forward (a lazy-init pattern), after wrap()."""

    def forward(self, h):
        if not hasattr(self, "gain"):
            self.gain = torch.nn.Parameter(torch.ones(h.shape[-1]))
        return h * self.gain


@pytest.mark.parametrize("stage", [0, 3])
def test_a_parameter_that_joins_the_model_after_wrap_is_refused_by_name(stage):
    """A parameter built in the first forward (or a module or adapter added after wrap()) was
    never stepped, in silence: its gradients piled up in .grad. Refused before the next forward,
    before anything is computed with it; built before wrap(), it trains."""
    cfg = make_config(zero={"stage": stage}, batch={"micro_batch_size": 2})
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), _LazyScale())
    loss = {"loss_fn": lambda m, batch: m(batch).square().mean()}
    engine = tiertrain.wrap(model, cfg, tiertrain.Topology.build(cfg.parallel), **loss)
    batch = torch.ones(2, 4)
    engine.backward(engine(batch))
    with pytest.raises(ConfigError, match=r"parameter '1.gain' joined the model after wrap\(\) \(built in a "
                                          r"forward.*once on a sample batch first"):
        engine(batch)
    with pytest.raises(ConfigError, match=r"joined the model after wrap"):  # (and again, if the loop caught it)
        engine(batch)
    engine.close()
    engine = tiertrain.wrap(model, cfg, tiertrain.Topology.build(cfg.parallel), **loss)
    engine.backward(engine(batch))
    assert engine.step()
    assert not torch.equal(engine.full_state_dict()["1.gain"], torch.ones(4)), "built before wrap(), it trains"
    engine.close()


def test_embeddings_resized_after_wrap_are_refused_by_name():
    """Hugging Face's resize_token_embeddings gives the embedding weight memory of its own."""
    pytest.importorskip("transformers")
    from zoo import llama_gqa

    config = make_config(zero={"stage": 2}, batch={"micro_batch_size": 2})
    torch.manual_seed(0)
    model = llama_gqa()
    engine = tiertrain.wrap(model, config, tiertrain.Topology.build(config.parallel))
    ids = torch.randint(0, 100, (2, 8))
    engine.backward(engine({"input_ids": ids, "labels": ids}))
    engine.step()
    model.resize_token_embeddings(model.config.vocab_size + 8, mean_resizing=False)
    with pytest.raises(ConfigError, match=r"parameter 'model.embed_tokens.weight' of a wrapped model was given memory "
                                          r"of its own \(its .data replaced, as by resize_token_embeddings"):
        engine({"input_ids": ids, "labels": ids})
    engine.close()


class _SparseGrad(torch.autograd.Function):
    """y = x @ w.T whose gradient for w comes back as a sparse tensor (as a custom kernel may)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return None, (g.t() @ x).to_sparse()


class _Bag(torch.nn.Module):
    def __init__(self, sparse: bool):
        super().__init__()
        self.emb = torch.nn.EmbeddingBag(32, 8, sparse=sparse)
        self.head = torch.nn.Parameter(torch.randn(4, 8) * 0.1)

    def forward(self, x, y, custom=False):
        h = self.emb(x)
        logits = _SparseGrad.apply(h, self.head) if custom else h @ self.head.t()
        return torch.nn.functional.cross_entropy(logits, y)


@pytest.mark.parametrize("stage", [0, 3])
def test_sparse_gradients_are_refused_by_name(stage):
    """An embedding built with sparse=True (or any operation giving a sparse gradient) failed
    inside the reducer with torch's "reshape is not implemented for sparse tensors"."""
    cfg = make_config(zero={"stage": stage}, batch={"micro_batch_size": 4})
    batch = (torch.randint(0, 32, (4, 5)), torch.randint(0, 4, (4,)))
    with pytest.raises(ConfigError, match=r"'emb': an embedding built with sparse=True gives sparse gradients.* "
                                          r"set sparse=False"):
        tiertrain.wrap(_Bag(sparse=True), cfg, tiertrain.Topology.build(cfg.parallel))
    engine = tiertrain.wrap(_Bag(sparse=False), cfg, tiertrain.Topology.build(cfg.parallel))
    engine.train_batch(iter([batch]))  # (dense: trains)
    with pytest.raises(RuntimeError, match=r"parameter 'head' received a torch.sparse_coo gradient"):
        engine.backward(engine((*batch, True)))
    engine.close()


def test_the_engine_switches_the_models_mode_as_a_wrapper_does():
    """model_engine.train() / .eval(), as a DeepSpeed engine or a DDP-wrapped module takes them."""
    cfg = make_config(zero={"stage": 2}, batch={"micro_batch_size": 2})
    model = make_model()
    engine = tiertrain.wrap(model, cfg, tiertrain.Topology.build(cfg.parallel))
    assert engine.eval() is engine and not any(m.training for m in model.modules())
    assert engine.train() is engine and all(m.training for m in model.modules())
    engine.close()


@pytest.mark.parametrize("stage", [0, 3])
def test_a_model_without_values_is_refused_by_name_at_wrap(stage):
    """A lazy module not yet called, or a model on the meta device (torch.device('meta'),
    accelerate's init_empty_weights), failed deep inside wrap() with torch's "Cannot copy out of
    meta tensor" or "Can't access the shape of an uninitialized parameter", naming neither
    the tensor nor the way out. Refused by name; the model is left to wrap once it has values."""
    config = make_config(zero={"stage": stage})
    topology = tiertrain.Topology.build(config.parallel)

    def loss(model, batch):
        return model(batch).square().mean()

    lazy = torch.nn.Sequential(torch.nn.LazyLinear(4), torch.nn.Linear(4, 1))
    with pytest.raises(ConfigError, match=r"'0\.weight', '0\.bias' are uninitialized.*once on a sample batch"):
        tiertrain.wrap(lazy, config, topology, loss_fn=loss)
    lazy(torch.ones(2, 3))
    tiertrain.wrap(lazy, config, topology, loss_fn=loss).close()
    with torch.device("meta"):
        meta = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    with pytest.raises(ConfigError, match=r"'0\.weight', '0\.bias', '1\.weight', '1\.bias' and 3 more are on the "
                                          r"meta device.*tiertrain\.load_pretrained\(engine, path\)"):
        tiertrain.wrap(meta, config, topology, loss_fn=loss)
    meta.to_empty(device="cpu")
    meta[1].running_mean = torch.empty(4, device="meta")
    with pytest.raises(ConfigError, match=r"'1\.running_mean' is on the meta device"):
        tiertrain.wrap(meta, config, topology, loss_fn=loss)


def _wrapped_twice(rank, world, wrapper):
    from torch.distributed.fsdp import fully_shard

    model = make_model()
    if wrapper == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        fully_shard(model)
    config = make_config(zero={"stage": 2}, batch={"micro_batch_size": 2})
    tiertrain.wrap(model, config, tiertrain.Topology.build(config.parallel))


@pytest.mark.parametrize("wrapper,named", [("ddp", r"'<the model> \(DistributedDataParallel\)'.*\.module"),
                                           ("fully_shard", r"'<the model> \(FSDPGPT\)', 'embed\.weight \(a DTensor\)'")])
def test_a_model_under_another_data_parallel_wrapper_is_refused_by_name(wrapper, named):
    """A model from accelerate's prepare() (DistributedDataParallel on several processes) or
    FSDP2's fully_shard. DDP's trained, with DDP's reducer hooked beside the engine's and every
    name prefixed "module." in full_state_dict(), checkpoints and save_pretrained() (whose export
    from_pretrained then finds no weight of); fully_shard's DTensors failed deep in the engine
    ("c10d.broadcast_.default does not have a sharding strategy"). Both are refused naming the
    wrapper and the plain module to give."""
    from tiertrain.testing import RankFailure, run_distributed

    with pytest.raises(RankFailure, match=named):
        run_distributed(_wrapped_twice, 2, wrapper, timeout=40)


def _accelerate_loop(rank, world, stage):
    from accelerate import Accelerator
    from torch.utils.data import DataLoader, TensorDataset

    accelerator = Accelerator(cpu=True)
    batches = global_batches(3, 2 * world)
    rows = TensorDataset(torch.cat([b["input_ids"] for b in batches]), torch.cat([b["labels"] for b in batches]))
    loader = accelerator.prepare(DataLoader(rows, batch_size=2))
    config = make_config(zero={"stage": stage}, batch={"micro_batch_size": 2})
    engine = tiertrain.wrap(make_model(), config, tiertrain.Topology.build(config.parallel))
    losses = []
    for input_ids, labels in loader:
        loss = engine({"input_ids": input_ids, "labels": labels})
        engine.backward(loss)
        engine.step()
        losses.append(float(accelerator.gather(loss.detach()).mean()))
    params = engine.full_state_dict()
    engine.close()
    return losses, params, accelerator.num_processes


@pytest.mark.timeout(90)
@pytest.mark.parametrize("stage", [2, 3])
def test_an_accelerate_loop_with_its_data_loader_trains_as_one_process(stage):
    """docs/migrate-deepspeed.md, "From an Accelerate loop": accelerate keeps the processes and
    shards the data (each rank every world-th batch), the engine trains."""
    from reference import Oracle, reference_train
    from tiertrain.testing import run_distributed

    losses, params, processes = run_distributed(_accelerate_loop, 2, stage, timeout=60)[0]
    assert processes == 2 and len(losses) == 3
    oracle = Oracle.run(reference_train, make_model(), make_config(batch={"micro_batch_size": 2}),
                        global_batches(3, 4))
    oracle.check(losses, params, f"an accelerate loop, stage {stage}")

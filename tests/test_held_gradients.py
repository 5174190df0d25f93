"""A wrapped model's ``p.grad`` between ``engine.backward()`` and ``engine.step()`` is an error
by name, never a silent "no gradient".

The engine keeps each gradient in its own flat buffers (reduced, at stages 2-3 only this
rank's shard), so ``p.grad`` was None there: the loop a DDP or FSDP2 user brings,
``engine.backward(loss); torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0);
engine.step()``, got a norm of 0 and clipped nothing, without a word. Now every read of a
gradient's values in that window raises :class:`tiertrain.HeldGradientError` naming the
parameter and the engine's own clipping (``optimizer.grad_clip``, whose norm is
``engine.last_grad_norm``: the value ``clip_grad_norm_`` returns on the plain model). Metadata
still answers, ``.grad`` is None again after the step (as after ``zero_grad()``), and training
is bit for bit what it was.
"""
from __future__ import annotations

import pytest
import torch

import tiertrain
from tiertrain.engine import default_loss
from reference import check_tensors, global_batches, make_config, make_model

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("one_torch_thread")]


def _wrapped(stage: int, model=None, accum: int = 1, **config):
    cfg = make_config(zero={"stage": stage}, batch={"micro_batch_size": 2, "grad_accum_steps": accum}, **config)
    model = make_model() if model is None else model
    return model, tiertrain.wrap(model, cfg, tiertrain.Topology.build(cfg.parallel))


@pytest.mark.parametrize("foreach", [None, False])
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_clip_grad_norm_of_the_model_between_backward_and_step_is_refused_by_name(stage, foreach):
    model, engine = _wrapped(stage)
    engine.backward(engine(global_batches(1, 2)[0]))
    with pytest.raises(tiertrain.HeldGradientError, match=r"read the gradient \(\.grad\) of parameter 'embed\.weight' "
                       r"between engine\.backward\(\) and engine\.step\(\).*set optimizer\.grad_clip: max_norm "
                       r"instead.*engine\.last_grad_norm"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=foreach)
    with pytest.raises(tiertrain.HeldGradientError, match="'blocks.0.attn.qkv.weight'"):
        model.blocks[0].attn.qkv.weight.grad.norm()  # a per-layer gradient log
    assert engine.step()
    engine.close()


def test_a_held_gradient_answers_its_metadata_and_step_leaves_none():
    model = make_model()
    frozen = model.norm.weight
    frozen.requires_grad_(False)
    model, engine = _wrapped(2, model)
    engine.backward(engine(global_batches(1, 2)[0]))
    p = model.blocks[0].mlp.fc1.weight
    assert p.grad is not None and p.grad.shape == p.shape and p.grad.dtype == p.dtype and p.grad.device == p.device
    assert "HeldGradient('blocks.0.mlp.fc1.weight'" in repr(p.grad)
    assert frozen.grad is None, "a frozen parameter has no gradient in torch either"
    engine.step()
    assert all(q.grad is None for q in model.parameters())
    model.zero_grad(set_to_none=False)  # (what a loop zeroing after the step does: nothing to zero)
    engine.close()


def test_a_gradient_the_loop_set_itself_is_refused_at_the_step():
    """The engine's update never reads .grad: a tensor put there would be ignored (and the next
    backward would add into it)."""
    model, engine = _wrapped(0)
    engine.backward(engine(global_batches(1, 2)[0]))
    model.norm.bias.grad = torch.zeros_like(model.norm.bias)
    with pytest.raises(tiertrain.HeldGradientError, match=r"\.grad of parameter 'norm\.bias' was set to a tensor"):
        engine.step()
    engine.close()
    assert all(q.grad is None for q in model.parameters()), "close() hands the model back without them"


@pytest.mark.parametrize("before", ["step", "backward"])
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_zero_grad_between_backward_and_step_is_refused_where_torch_would_drop_the_gradients(stage, before):
    """A loop dropping a batch (or zeroing at every micro-batch) calls zero_grad() after its
    backward: torch would forget those gradients; the engine holds them in its flat buffers
    and would apply them at the next step, so it refuses, naming the remedy."""
    model, engine = _wrapped(stage, accum=2)
    batches = iter(global_batches(2, 2))
    engine.backward(engine(next(batches)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # (the loop's own: zero_grad reaches every .grad)
    optimizer.zero_grad()
    loss = engine(next(batches))
    match = (r"\.grad of parameters 'embed\.weight', .* was set to None between engine\.backward\(\) and "
             r"engine\.step\(\) \(optimizer\.zero_grad\(\) or model\.zero_grad\(\) there\?\).*would apply them at "
             r"the next step.*call zero_grad\(\) only after engine\.step\(\)")
    with pytest.raises(tiertrain.HeldGradientError, match=match):
        engine.step() if before == "step" else engine.backward(loss)
    engine.close()


def test_zero_grad_without_set_to_none_between_backward_and_step_is_refused_too():
    model, engine = _wrapped(2)
    engine.backward(engine(global_batches(1, 2)[0]))
    with pytest.raises(tiertrain.HeldGradientError, match=r"zero_\(\) of the gradient \(\.grad\) of parameter "
                       r"'embed\.weight' .*set_to_none=False.*would apply them at the next step"):
        model.zero_grad(set_to_none=False)
    engine.close()


@pytest.mark.parametrize("stage", [0, 3])
def test_the_engines_clip_gives_the_norm_clip_grad_norm_returns(stage):
    """The remedy the error names: optimizer.grad_clip clips in step(), and engine.last_grad_norm
    is clip_grad_norm_'s return value on the plain model (float64 oracle), also where held
    gradients were put in and taken out between two micro-batches (grad_accum_steps=2)."""
    batches = global_batches(1, 4)
    ref = {}
    for dtype in (torch.float32, torch.float64):
        plain = make_model().to(dtype)
        default_loss(plain, batches[0]).backward()
        ref[dtype] = {"norm": torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0).reshape(1)}
    model, engine = _wrapped(stage, accum=2, optimizer={"grad_clip": 1.0})
    for j in range(2):
        engine.backward(engine({k: v[2 * j: 2 * j + 2] for k, v in batches[0].items()}))
        assert engine.step() == (j == 1)
    check_tensors({"norm": torch.tensor([engine.last_grad_norm])}, ref[torch.float32], ref[torch.float64],
                  "engine.last_grad_norm")
    engine.close()


def test_a_lora_adapter_on_a_hugging_face_llama_at_stage_3_names_its_first_adapter_weight():
    """The frozen base has no gradient (in torch either); the adapters' are held: the error names
    the first one clip_grad_norm_ reads, at stage 3, bf16."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = peft.get_peft_model(transformers.LlamaForCausalLM(config),
                                peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    model, engine = _wrapped(3, model, precision={"dtype": "bf16"})
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    engine.backward(engine({"input_ids": ids, "labels": ids}))
    with pytest.raises(tiertrain.HeldGradientError,
                       match=r"of parameter 'base_model\.model\.model\.layers\.0\.self_attn\.q_proj\.lora_A\.default\."
                             r"weight' between"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    assert engine.step()
    engine.close()

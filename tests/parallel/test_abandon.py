"""A stopping run's update ends at the next decoder layer, forward or backward, eager, checkpointed or
compiled, and one abandoned before its first optimizer step changes neither the LoRA weights nor the
optimizer state."""

import threading

import pytest
import torch

from graft.config import load_config
from graft.lora.attach import lora_parameters
from graft.parallel.abandon import Abandoned, stop_points
from graft.parallel.dist import Dist
from graft.parallel.parallelize import decoder_layers, parallelize
from graft.train.update import policy_update
from tests.helpers import trained_like_peft_model
from tests.parallel.test_parallelize import _batch


def _model(model_dir, overrides: list[str]):
    config = load_config(None, ["train.lr=1e-2", "train.max_tokens_per_micro_batch=", *overrides])
    model = parallelize(trained_like_peft_model(model_dir), Dist(),
                        activation_checkpointing=config.train.activation_checkpointing,
                        compile_layers=config.train.compile)
    return model, torch.optim.AdamW(lora_parameters(model).values(), lr=config.train.lr), config


@pytest.mark.parametrize("overrides", [[], ["train.activation_checkpointing=true"], ["train.compile=true"]],
                         ids=["eager", "checkpointed", "compiled"])
def test_an_update_ends_at_the_next_layer_forward_and_backward(base_dir, overrides):
    from torch._dynamo.utils import counters

    model, optimizer, config = _model(base_dir, overrides)
    stopping = stop_points(model)
    assert stop_points(model) is stopping  # installed once: a compiled layer is not compiled again
    policy_update(model, optimizer, _batch(4, 3), config.train, pad_id=0, step=0)
    compiled = counters["stats"]["unique_graphs"]
    first, last = decoder_layers(model)[0], decoder_layers(model)[-1]
    entered = []
    handles = [last.register_forward_pre_hook(lambda *_: entered.append(1)),
               first.register_forward_hook(lambda *_: stopping.set())]  # set mid-forward: the next layer raises
    with pytest.raises(Abandoned):
        policy_update(model, optimizer, _batch(4, 3), config.train, pad_id=0, step=1)
    assert entered == [] and counters["stats"]["unique_graphs"] == compiled
    for handle in handles:
        handle.remove()

    stopping.clear()
    optimizer.zero_grad(set_to_none=True)
    loss = model(torch.tensor([_batch(2, 2).sequences[0][0]])).logits.float().logsumexp(-1).mean()
    stopping.set()  # between forward and backward: the backward stops where it reaches the last layer
    with pytest.raises(Abandoned):
        loss.backward()
    assert all(p.grad is None for p in lora_parameters(model).values())  # stopped at the last layer's output


def test_an_update_abandoned_before_its_first_step_changes_nothing(base_dir):
    model, optimizer, config = _model(base_dir, ["train.mini_batches=2"])
    policy_update(model, optimizer, _batch(4, 3), config.train, pad_id=0, step=0)
    weights = {name: p.detach().clone() for name, p in lora_parameters(model).items()}
    state = [v.clone() for s in optimizer.state.values() for v in s.values()]
    stop_points(model).set()
    with pytest.raises(Abandoned):
        policy_update(model, optimizer, _batch(4, 3, seed=1), config.train, pad_id=0, step=1)
    assert all(torch.equal(p, weights[name]) for name, p in lora_parameters(model).items())
    assert all(map(torch.equal, [v for s in optimizer.state.values() for v in s.values()], state))


def test_an_update_on_another_thread_ends_soon_after_the_event(base_dir):
    """As the trainer runs it: the update on a worker thread, the event set from the loop's thread."""
    model, optimizer, config = _model(base_dir, ["train.epochs=50"])
    stopping, started, outcome = stop_points(model), threading.Event(), []
    decoder_layers(model)[0].register_forward_pre_hook(lambda *_: started.set())

    def update() -> None:
        try:
            policy_update(model, optimizer, _batch(4, 3), config.train, pad_id=0)
        except Abandoned as error:
            outcome.append(error)

    worker = threading.Thread(target=update)
    worker.start()
    assert started.wait(60)
    stopping.set()
    worker.join(10)
    assert not worker.is_alive() and len(outcome) == 1

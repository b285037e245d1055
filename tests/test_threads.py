"""Several threads at once give the weights one thread gives, bit for bit, and never crash.

PyTorch runs concurrent ``backward()`` calls from several threads, and each accelerator's part
of a backward on that device's own thread: a model split over two devices runs its gradient
hooks on two threads at once. Each case here is repeated ``TRIALS`` times with threads switched
every 10 microseconds (``threaded.interleaved``), and compared with the same runs on one
thread: weights and optimizer state bitwise equal, and no warning. See docs/design.md, "Who
owns what".
"""

from __future__ import annotations

import functools
import gc
import random
import threading

import pytest
import torch
from threaded import (
    CONFIGS,
    MIXEDOPT_AUTOCAST_CONFIGS,
    WIDTHS,
    Config,
    Training,
    assert_bitwise_equal,
    describe,
    in_step,
    interleaved,
    model,
    optimizer,
    run_alone,
    run_together,
)

import mixedopt

# Repetitions of each stress test (marked slow: the README's test command and CI run them).
TRIALS = 50

# CONFIGS, float16 ones first: threads next to each other in a trial share a storage (one per
# dtype) but where the two halves meet.
BY_DTYPE = sorted(CONFIGS, key=lambda config: config.dtype == torch.bfloat16)

_alone: dict[tuple[Config, int, bool], list[torch.Tensor]] = {}


@pytest.fixture(scope="module", autouse=True)
def compiled_first():
    """Every kernel fused=True compiles here, before the trials, on one thread.

    ``torch.compiler.is_compiling()`` is process-wide in torch 2.13: while one thread compiles,
    torch's functional updates on every other thread take their branches for compiled code
    (Adam's bias corrections as float32 tensors, for one), and round differently from a run
    alone. torch.optim is affected alike; the trials compare threads, not that.
    """
    for config in CONFIGS:
        if config.fused:
            alone(config, seed=0)
            training = Training(config, seed=0)
            run_alone(functools.partial(remove_then_train, training))  # float32 gradients


def alone(config: Config, seed: int, in_backward: bool = False) -> list[torch.Tensor]:
    """The weights and state of ``config``'s run from ``seed``, trained on one thread alone."""
    key = (config, seed, in_backward)
    if key not in _alone:
        training = Training(config, seed, in_backward)
        run_alone(training)
        _alone[key] = training.result()
    return _alone[key]


def threads_of_their_own(count: int, trials: int, configs: list[Config] = BY_DTYPE) -> None:
    """``count`` threads each train their own model with their own optimizer, ``trials`` times.

    Trial ``t`` gives its threads the next ``count`` configurations of ``CONFIGS``: every
    optimizer, default and fused, with and without GradScaler and max_grad_norm, float16 and
    bfloat16, meet each other on threads at once.
    """
    for trial in range(trials):
        chosen = [configs[(trial * count + i) % len(configs)] for i in range(count)]
        expected = [alone(config, seed=i) for i, config in enumerate(chosen)]
        trainings = [Training(config, seed=i) for i, config in enumerate(chosen)]
        with interleaved() as caught:
            run_together(trainings)
        assert not caught, describe(caught)
        for training, reference in zip(trainings, expected, strict=True):
            assert_bitwise_equal(training.result(), reference, f"trial {trial}, {training.config}")


@pytest.mark.slow
@pytest.mark.parametrize("count", [2, 4, 8])
def test_threads_training_their_own_models_give_the_weights_of_one_thread(count):
    threads_of_their_own(count, TRIALS)


def test_two_threads_training_their_own_models_give_the_weights_of_one_thread():
    # The quick loop's share of the test above.
    threads_of_their_own(2, 2)


@pytest.mark.slow
def test_threads_training_under_mixedopt_autocast_give_the_weights_of_one_thread():
    threads_of_their_own(4, TRIALS // 5, MIXEDOPT_AUTOCAST_CONFIGS)


def test_two_threads_training_under_mixedopt_autocast_give_the_weights_of_one_thread():
    # The quick loop's share of the test above.
    threads_of_their_own(2, 2, MIXEDOPT_AUTOCAST_CONFIGS)


class SplitModel:
    """One model in ``parts`` disjoint parts, each with its own input, under one optimizer.

    What a model split over devices looks like to the storage: each part's backward runs on a
    thread of its own (here one backward per part, each on its thread; on devices, one backward
    whose parts run on the devices' threads).
    """

    def __init__(self, config: Config, parts: int, micro_batches: int, seed: int = 0) -> None:
        self.training = Training(config, seed)
        self.parts = [model(seed + 10 + i) for i in range(parts)]
        params = [p for part in self.parts for p in part.parameters()]
        self.training.opt = optimizer(config, params)
        generator = torch.Generator().manual_seed(seed + 2000)
        self.inputs = [
            [torch.randn(4, WIDTHS[0], generator=generator) for _ in range(micro_batches)]
            for _ in range(parts)
        ]

    def backwards(self, part: int):
        def run() -> None:
            for x in self.inputs[part]:
                in_step()
                self.training.loss(x, self.parts[part]).backward()

        return run

    def one_after_the_other(self) -> None:
        for part in range(len(self.parts)):
            self.backwards(part)()

    def train(self, steps: int, together: bool) -> None:
        for _ in range(steps):
            if together:
                run_together([self.backwards(part) for part in range(len(self.parts))])
            else:
                run_alone(self.one_after_the_other)
            self.training.step()

    def result(self) -> list[torch.Tensor]:
        opt = self.training.opt
        found = [p.detach().clone() for part in self.parts for p in part.parameters()]
        for state in opt.state_dict()["state"].values():
            found += [v.clone() for _, v in sorted(state.items()) if torch.is_tensor(v)]
        return found


def split_model(configs: list[Config], parts: int, micro_batches: int, trials: int) -> None:
    """``trials`` trials of a model in ``parts``, trial ``t`` with ``configs[t % len(configs)]``."""
    for trial in range(trials):
        config = configs[trial % len(configs)]
        reference = SplitModel(config, parts, micro_batches)
        reference.train(steps=2, together=False)
        split = SplitModel(config, parts, micro_batches)
        with interleaved() as caught:
            split.train(steps=2, together=True)
        assert not caught, describe(caught)
        assert_bitwise_equal(split.result(), reference.result(), f"trial {trial}, {config}")


@pytest.mark.slow
def test_one_optimizer_over_parts_whose_backwards_run_at_once_gives_the_weights_of_one_thread():
    split_model(CONFIGS, parts=2, micro_batches=1, trials=TRIALS)


@pytest.mark.slow
def test_accumulation_over_parts_whose_backwards_run_at_once_gives_the_weights_of_one_thread():
    split_model(CONFIGS, parts=3, micro_batches=3, trials=TRIALS)


@pytest.mark.slow
def test_parts_under_mixedopt_autocast_whose_backwards_run_at_once_give_one_threads_weights():
    split_model(MIXEDOPT_AUTOCAST_CONFIGS, parts=3, micro_batches=3, trials=TRIALS // 5)


def test_two_parts_whose_backwards_run_at_once_give_the_weights_of_one_thread():
    # The quick loop's share of the two tests above.
    split_model([Config("AdamW")], parts=2, micro_batches=2, trials=2)


def churn(seed: int) -> None:
    """Build, train, drop and collect optimizers: let go at once, in a cycle, or kept."""
    rng = random.Random(seed)
    kept = []
    for _ in range(3):
        training = Training(rng.choice(CONFIGS), seed=rng.randrange(100))
        training.loss(training.inputs[0]).backward()
        training.step()
        what = rng.randrange(3)
        if what == 0:
            training.opt.remove_grad_storage()
        elif what == 1:
            training.opt.cycle = training.opt  # only the collector frees it
        else:
            kept.append(training)
        del training
    if seed % 5 == 0:  # the collector is slow in a process of many objects: a trial in five
        gc.collect()


@pytest.mark.slow
def test_optimizers_built_and_collected_while_others_train_change_nothing():
    for trial in range(TRIALS):
        chosen = [BY_DTYPE[(trial * 3 + i) % len(BY_DTYPE)] for i in range(3)]
        expected = [alone(config, seed=i) for i, config in enumerate(chosen)]
        trainings = [Training(config, seed=i) for i, config in enumerate(chosen)]
        with interleaved() as caught:
            run_together([*trainings, functools.partial(churn, seed=trial)])
        assert not caught, describe(caught)
        for training, reference in zip(trainings, expected, strict=True):
            assert_bitwise_equal(training.result(), reference, f"trial {trial}, {training.config}")


def remove_then_train(training: Training) -> None:
    training.opt.remove_grad_storage()
    training()


@pytest.mark.slow
def test_step_in_backward_and_remove_grad_storage_on_a_thread_while_others_train():
    in_backward_configs = [c for c in CONFIGS if c.scaling == "none"]
    for trial in range(TRIALS):
        chosen = [BY_DTYPE[(trial * 2 + i) % len(BY_DTYPE)] for i in range(2)]
        stepping = in_backward_configs[trial % len(in_backward_configs)]
        expected = [alone(config, seed=i) for i, config in enumerate(chosen)]
        expected_in_backward = alone(stepping, seed=7, in_backward=True)
        trainings = [Training(config, seed=i) for i, config in enumerate(chosen)]
        in_backward = Training(stepping, seed=7, in_backward=True)
        removed = Training(chosen[0], seed=9)
        with interleaved() as caught:
            run_together([*trainings, in_backward, functools.partial(remove_then_train, removed)])
        assert not caught, describe(caught)
        for training, reference in zip(trainings, expected, strict=True):
            assert_bitwise_equal(training.result(), reference, f"trial {trial}, {training.config}")
        assert_bitwise_equal(in_backward.result(), expected_in_backward, f"trial {trial}")
        params = removed.model.parameters()
        assert all(p.grad is None or p.grad.dtype == torch.float32 for p in params)


def backward(training: Training, x: torch.Tensor) -> None:
    training.loss(x).backward()


def overlapping_micro_batches(trials: int, forward: str = "torch.autocast") -> None:
    """Two backwards of one model, on two threads at once: every gradient is added once.

    A 16-bit gradient is rounded once per backward, so the sum depends on which backward
    stores first: each parameter's gradient is bitwise the one of the two backwards run one
    after the other, in one order or the other.
    """
    config = Config("AdamW", forward=forward)
    inputs = Training(config, seed=0).inputs[:2]

    def gradients(order):
        training = Training(config, seed=0)
        run_alone(lambda: [training.loss(inputs[i]).backward() for i in order])
        return [(p.grad.clone(), training.opt.true_grad(p)) for p in training.model.parameters()]

    orders = [gradients((0, 1)), gradients((1, 0))]
    for trial in range(trials):
        training = Training(config, seed=0)
        with interleaved() as caught:
            run_together([functools.partial(backward, training, x) for x in inputs])
        assert not caught, describe(caught)
        for i, p in enumerate(training.model.parameters()):
            found = (p.grad, training.opt.true_grad(p))
            assert any(
                torch.equal(found[0], stored) and torch.equal(found[1], true)
                for stored, true in (order[i] for order in orders)
            ), f"trial {trial}: parameter {i}"
        training.step()  # and the step takes them


@pytest.mark.slow
def test_overlapping_backwards_of_one_model_add_every_gradient_once():
    overlapping_micro_batches(TRIALS)


def test_two_overlapping_backwards_of_one_model_add_every_gradient_once():
    # The quick loop's share of the test above.
    overlapping_micro_batches(3)


def test_two_overlapping_backwards_under_mixedopt_autocast_add_every_gradient_once():
    overlapping_micro_batches(TRIALS // 5, forward="mixedopt.autocast")


class Waiting(torch.autograd.Function):
    """The identity, whose backward waits for ``release`` (set when it has started)."""

    started = threading.Event()
    release = threading.Event()

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        Waiting.started.set()
        assert Waiting.release.wait(timeout=60)
        return grad


def test_step_while_a_backward_of_its_parameters_runs_on_another_thread_is_refused():
    # The backward has claimed the first parameter's gradient (waiting in its bucket, float32)
    # when it stops in Waiting's backward, before the second's: step() would see half a
    # backward's gradients. torch.optim races there; mixedopt says so, and changes nothing.
    first, second = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    opt = mixedopt.SGD([first, second], lr=0.1)
    loss = (Waiting.apply(second * 2.0) + first).sum()
    Waiting.started.clear()
    Waiting.release.clear()
    thread = threading.Thread(target=loss.backward)
    thread.start()
    try:
        assert Waiting.started.wait(timeout=60)
        with pytest.raises(RuntimeError, match="backward still running.*1 of its parameter"):
            opt.step()
        assert torch.equal(first, torch.ones(4)) and torch.equal(second, torch.ones(4))
    finally:
        Waiting.release.set()
        thread.join(timeout=60)
    opt.step()  # once it has ended
    assert torch.equal(first, torch.full((4,), 0.9)) and torch.equal(second, torch.full((4,), 0.8))


def test_reading_the_claims_survives_a_hook_claiming_in_the_middle():
    """Another thread's hook can claim a slot whenever the garbage collector runs Python code
    (its finalizers let other threads run): reading the claims must not fail then."""
    params = [torch.nn.Parameter(torch.randn(4)) for _ in range(64)]
    optimizer = mixedopt.SGD(params, lr=0.1)
    storage = optimizer._grad_storage
    slots = [storage._slots[id(p)] for p in params]
    for slot in slots[:32]:
        storage._claims[slot] = 10**9  # claims of a backward that is not this thread's
    spare = iter(slots[32:])

    def claim(phase, info):  # a hook claiming a slot while the collector runs
        if phase == "start":
            slot = next(spare, None)
            if slot is not None:
                storage._claims.setdefault(slot, 10**9 + 1)

    threshold = gc.get_threshold()
    gc.callbacks.append(claim)
    gc.set_threshold(1)
    try:
        for _ in range(32):
            storage.held_by_other_backwards({id(p) for p in params})
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(claim)
        storage._claims.clear()

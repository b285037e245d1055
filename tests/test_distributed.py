"""Distributed engines: FSDP2, DDP and ZeroRedundancyOptimizer, against torch.optim.

Every test starts two processes that form a gloo group on 127.0.0.1 (a free port), trains a
mixedopt model and a torch.optim twin under the same engine with the same data, and compares.
The checks run inside the workers; the parent joins them with a deadline, kills them past it and
reports each rank's traceback.

``python tests/test_distributed.py --memory`` prints the bytes of gradients and optimizer state
per parameter under each engine (the figures in notes/distributed.md).
"""

from __future__ import annotations

import os
import queue
import socket
import sys
import time
import traceback
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import assert_close_to_float32_noise
from torch import nn

import mixedopt

WORLD = 2
DEADLINE_S = 90  # per test, both ranks together

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="needs torch.distributed with gloo",
)

# mixedopt class, torch.optim class, keyword arguments (with SGD's momentum, to have state)
PAIRS = {
    "Adam": (mixedopt.Adam, torch.optim.Adam, {"lr": 1e-2}),
    "AdamW": (mixedopt.AdamW, torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "SGD": (mixedopt.SGD, torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9}),
    "RMSprop": (mixedopt.RMSprop, torch.optim.RMSprop, {"lr": 1e-3}),
}


# ---------------------------------------------------------------------------- running two ranks


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, fn, args: tuple, results) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=WORLD,
            timeout=timedelta(seconds=DEADLINE_S),
        )
        try:
            payload = fn(rank, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, None, payload))
    except BaseException:
        results.put((rank, traceback.format_exc(), None))


def run_ranks(fn, *args, deadline: float = DEADLINE_S) -> list:
    """Run ``fn(rank, *args)`` on 2 gloo ranks; return each rank's result, or fail clearly."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, fn, args, results)) for r in range(WORLD)]
    for p in procs:
        p.start()
    outcome: dict[int, tuple] = {}
    try:
        end = time.monotonic() + deadline
        while len(outcome) < WORLD:
            left = end - time.monotonic()
            if left <= 0:
                break
            try:
                rank, error, payload = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    break  # a rank died without reporting
                continue
            outcome[rank] = (error, payload)
        for p in procs:
            p.join(timeout=max(0.0, min(10.0, end - time.monotonic())))
    finally:
        hung = [p for p in procs if p.is_alive()]
        for p in hung:
            p.kill()
            p.join(timeout=5)
    errors = [f"rank {r}:\n{outcome[r][0]}" for r in sorted(outcome) if outcome[r][0]]
    if errors:
        pytest.fail("\n".join(errors), pytrace=False)
    missing = [r for r in range(WORLD) if r not in outcome]
    if missing:
        codes = {r: procs[r].exitcode for r in range(WORLD)}
        pytest.fail(
            f"ranks {missing} gave no result within {deadline} s (exit codes {codes}; killed "
            f"{len(hung)} hung process(es))",
            pytrace=False,
        )
    return [outcome[r][1] for r in range(WORLD)]


# ---------------------------------------------------------------------------- shared pieces


def _model() -> nn.Module:
    # Row counts 10, 3 and 1 shard unevenly over 2 ranks: rank 1 holds an empty shard of the
    # last layer.
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3), nn.Tanh(), nn.Linear(3, 1))


def _batches(rank: int, count: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    return [torch.randn(8, 6, generator=gen) * 3 for _ in range(count)]


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().square().mean()


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _assert_same_weights(model: nn.Module, reference: nn.Module, what: str) -> None:
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert_close_to_float32_noise(_full(p.detach()), _full(q.detach()), msg=f"{what}: {name}")


# ---------------------------------------------------------------------------- FSDP2


def _fsdp_parity(rank: int) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policies = {
        "no policy": None,
        "bf16": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16),
        "bf16 reduce fp16": MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float16
        ),
    }
    for policy_name, policy in policies.items():
        _fsdp_parity_under(rank, policy_name, policy)
    _fsdp_large_gradient_clipped(rank)


def _fsdp_large_gradient_clipped(rank: int) -> None:
    """A sharded gradient of more than SLICE_ELEMENTS elements (1025 rows: uneven), clipped."""
    from torch.distributed.fsdp import fully_shard

    def build() -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(1024, 1025), nn.Tanh(), nn.Linear(1025, 1))
        fully_shard(model[0])
        return fully_shard(model)

    model, reference = build(), build()
    assert model[0].weight.numel() > mixedopt._budget.CPU_CAPACITY
    opt = mixedopt.Adam(model.parameters(), lr=1e-3, max_grad_norm=0.01)
    ref = torch.optim.Adam(reference.parameters(), lr=1e-3)
    x = torch.randn(4, 1024, generator=torch.Generator().manual_seed(rank))
    for step in range(2):
        for m, o in ((model, opt), (reference, ref)):
            o.zero_grad()
            _loss(m, x).backward()
        total = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.01)
        opt.step()
        ref.step()
        assert_close_to_float32_noise(opt.last_grad_norm, _full(total))
        _assert_same_weights(model, reference, f"large gradient, step {step}")


def _fsdp_parity_under(rank: int, policy_name: str, policy) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    def shard(model: nn.Module) -> nn.Module:
        kwargs = {} if policy is None else {"mp_policy": policy}
        for layer in (model[0], model[2], model[4]):
            fully_shard(layer, **kwargs)
        return fully_shard(model, **kwargs)

    # (optimizer, max_grad_norm, backward() calls per step, sync on the first of them)
    cases = [(name, None, 1, True) for name in PAIRS]
    cases += [("Adam", 0.05, 1, True), ("Adam", None, 2, True), ("AdamW", None, 2, False)]
    for name, clip, micro, sync_first in cases:
        what = f"{policy_name} {name} clip={clip} micro={micro} sync_first={sync_first}"
        ours_cls, theirs_cls, kwargs = PAIRS[name]
        model, reference = shard(_model()), shard(_model())
        opt = ours_cls(model.parameters(), max_grad_norm=clip, **kwargs)
        ref = theirs_cls(reference.parameters(), **kwargs)
        for p in model.parameters():
            assert isinstance(p, DTensor), what
            assert p not in opt._grad_storage, f"{what}: FSDP2 parameters get no storage"
        batches = _batches(rank, 3 * micro)
        for step in range(3):
            for m, o in ((model, opt), (reference, ref)):
                o.zero_grad()
                for i in range(micro):
                    m.set_requires_gradient_sync(sync_first or i == micro - 1)
                    _loss(m, batches[step * micro + i]).backward()
            total = None
            if clip is not None:
                total = torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
            for p in model.parameters():
                # FSDP2 casts reduced gradients back to the sharded parameter's dtype.
                assert isinstance(p.grad, DTensor) and p.grad.dtype == torch.float32, what
            opt.step()
            ref.step()
            if total is not None:
                assert_close_to_float32_noise(opt.last_grad_norm, _full(total), msg=what)
            _assert_same_weights(model, reference, f"{what} step {step}")
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            for key, value in ref.state[q].items():
                mine = opt.state[p][key]
                assert type(mine) is type(value), f"{what}: state {key} is {type(mine)}"
                assert_close_to_float32_noise(_full(mine), _full(value), msg=f"{what}: {key}")


def test_fsdp2_matches_torch_optim():
    """Without and with MixedPrecisionPolicy; every optimizer; clipping; accumulation."""
    run_ranks(_fsdp_parity)


# ---------------------------------------------------------------------------- DDP


def _ddp_parity(rank: int) -> None:
    for bucket_view in (False, True):
        for optimizer_first in (False, True):
            _ddp_parity_with(rank, bucket_view, optimizer_first, silence=False)
    _ddp_parity_with(rank, bucket_view=True, optimizer_first=False, silence=True)


def _ddp_parity_with(rank: int, bucket_view: bool, optimizer_first: bool, silence: bool) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    what = f"DDP gradient_as_bucket_view={bucket_view} optimizer_first={optimizer_first}"
    what += " after remove_grad_storage()" if silence else ""

    model = _model()
    if optimizer_first:
        opt = mixedopt.Adam(model.parameters(), lr=1e-2)
        ddp = DDP(model, gradient_as_bucket_view=bucket_view)
    else:
        ddp = DDP(model, gradient_as_bucket_view=bucket_view)
        opt = mixedopt.Adam(ddp.parameters(), lr=1e-2)
    if silence:
        opt.remove_grad_storage()
    reference = DDP(_model(), gradient_as_bucket_view=bucket_view)
    ref = torch.optim.Adam(reference.parameters(), lr=1e-2)
    batches = _batches(rank, 6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            for m, o in ((ddp, opt), (reference, ref)):
                o.zero_grad()
                with m.no_sync():  # accumulate one micro-batch locally, reduce on the next
                    _loss(m, batches[2 * step]).backward()
                _loss(m, batches[2 * step + 1]).backward()
            for p in ddp.parameters():
                assert p.grad.dtype == torch.float32, what
            opt.step()
            ref.step()
            _assert_same_weights(ddp, reference, f"{what} step {step}")
    ours = [str(w.message) for w in caught if "mixedopt" in str(w.message)]
    if silence:
        assert ours == [], f"{what}: {ours}"
    else:
        assert len(ours) == 1, f"{what}: {ours}"
        assert "DistributedDataParallel" in ours[0] and "remove_grad_storage()" in ours[0], what


def test_ddp_matches_torch_optim():
    """Either construction order, with and without gradient_as_bucket_view, with no_sync()."""
    run_ranks(_ddp_parity)


def _ddp_under_mixedopt_autocast(rank: int) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    def wide() -> nn.Module:  # a weight of 65,536 elements: its cast would hand over its gradient
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 256), nn.Tanh(), nn.Linear(256, 256), nn.Linear(256, 1))

    ddp, reference = DDP(wide()), DDP(wide())
    opt = mixedopt.Adam(ddp.parameters(), lr=1e-2)
    ref = torch.optim.Adam(reference.parameters(), lr=1e-2)
    batches = _batches(rank, 3)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="mixedopt: .* DistributedDataParallel")
        for step in range(3):
            for m, o, region in ((ddp, opt, mixedopt.autocast), (reference, ref, torch.autocast)):
                o.zero_grad()
                with region("cpu", dtype=torch.float16):
                    loss = _loss(m, batches[step])
                loss.backward()
            for p in ddp.parameters():  # reduced by DDP, which needs them float32
                assert p.grad.dtype == torch.float32, f"step {step}"
            opt.step()
            ref.step()
            _assert_same_weights(ddp, reference, f"DDP under mixedopt.autocast step {step}")


def test_ddp_under_mixedopt_autocast_matches_torch_optim_under_torch_autocast():
    """DDP reduces float32 gradients: the casts leave them to autograd."""
    run_ranks(_ddp_under_mixedopt_autocast)


# ---------------------------------------------------------------------------- ZeRO


def _zero_parity(rank: int) -> None:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp, reference = DDP(_model()), DDP(_model())
    opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=mixedopt.Adam, lr=1e-2)
    ref = ZeroRedundancyOptimizer(reference.parameters(), optimizer_class=torch.optim.Adam, lr=1e-2)
    assert isinstance(opt.optim, mixedopt.Adam)
    batches = _batches(rank, 3)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="mixedopt: .* DistributedDataParallel")
        for step in range(3):
            for m, o in ((ddp, opt), (reference, ref)):
                o.zero_grad()
                _loss(m, batches[step]).backward()
            opt.step()
            ref.step()
            _assert_same_weights(ddp, reference, f"ZeRO step {step}")


def test_zero_redundancy_optimizer_with_ddp_matches_torch_optim():
    run_ranks(_zero_parity)


# ---------------------------------------------------------------------------- step_in_backward


def _step_in_backward_refused(rank: int) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(_model())
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="mixedopt: .* DistributedDataParallel")
        opt = mixedopt.Adam(ddp.parameters(), lr=1e-2)
        _loss(ddp, _batches(rank, 1)[0]).backward()  # DDP's gradients, float32
        opt.step()
    weights = [p.detach().clone() for p in ddp.parameters()]
    with pytest.raises(RuntimeError, match="DistributedDataParallel owns the gradients"):
        with opt.step_in_backward():
            pass
    for p, w in zip(ddp.parameters(), weights, strict=True):
        assert torch.equal(p.detach(), w)

    sharded = fully_shard(_model())
    opt = mixedopt.Adam(sharded.parameters(), lr=1e-2)
    with pytest.raises(RuntimeError, match=r"FSDP2 \(fully_shard\) owns the gradients"):
        with opt.step_in_backward():
            pass


def test_step_in_backward_is_refused_under_ddp_and_fsdp2():
    run_ranks(_step_in_backward_refused)


# ---------------------------------------------------------------------------- memory figures


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (local shards of DTensors)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "to_local"):
            t = t.to_local()
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _memory(rank: int, engine: str, which: str) -> dict:
    """Bytes of gradients (and DDP's buckets) and of optimizer state after one step."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(4)])
    count = sum(p.numel() for p in model.parameters())
    opt_cls = mixedopt.Adam if which == "mixedopt" else torch.optim.Adam
    buckets = 0
    if engine.startswith("fsdp2"):
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        kwargs = {"mp_policy": policy} if engine == "fsdp2-bf16" else {}
        for layer in model:
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)
        wrapped = model
    elif engine == "none":
        wrapped = model
    else:  # DDP, with or without ZeRO; its buckets hold one float32 copy of every gradient
        bucket_view = engine.endswith("bucket_view")
        wrapped = DDP(model, gradient_as_bucket_view=bucket_view)
        buckets = 0 if bucket_view else 4 * count
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if engine.startswith("zero"):
            opt = ZeroRedundancyOptimizer(wrapped.parameters(), optimizer_class=opt_cls, lr=1e-3)
            local = opt.optim
        else:
            opt = local = opt_cls(wrapped.parameters(), lr=1e-3)
        x = torch.randn(16, 512)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=engine == "none"):
            loss = wrapped(x).float().square().mean()
        loss.backward()
        params = list(wrapped.parameters())
        grads = _storage_bytes(p.grad for p in params) + buckets
        grad_dtype = str(params[0].grad.dtype).replace("torch.", "")
        opt.step()
    state = _storage_bytes(
        v for s in local.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0
    )
    return {"count": count, "grads": grads, "state": state, "grad_dtype": grad_dtype}


def print_memory_table() -> None:
    engines = ["none", "ddp", "ddp-bucket_view", "zero-ddp", "zero-ddp-bucket_view"]
    engines += ["fsdp2", "fsdp2-bf16"]
    print(
        f"{'engine':22} {'optimizer':9} {'grad dtype':10} "
        f"{'grads+state B/param, per rank':>30} {'summed over ranks':>18}"
    )
    for engine in engines:
        for which in ("torch", "mixedopt"):
            rows = run_ranks(_memory, engine, which, deadline=120)
            count = rows[0]["count"]
            per_rank = [(r["grads"] + r["state"]) / count for r in rows]
            split = " / ".join(f"{r['grads'] / count:.2f}+{r['state'] / count:.2f}" for r in rows)
            print(
                f"{engine:22} {which:9} {rows[0]['grad_dtype']:10} {split:>30} "
                f"{sum(per_rank):18.2f}"
            )


if __name__ == "__main__":
    if "--memory" in sys.argv:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        print_memory_table()
    else:
        print(__doc__)

"""Train mixedopt.AdamW and torch.optim.AdamW side by side in Trainer, Lightning and accelerate.

It checks the recipes of docs/frameworks.md and docs/gradscaler.md: with float16
``.grad`` (the default) the framework's clipping must be off and mixedopt's ``max_grad_norm`` on;
with ``grad_dtype=torch.bfloat16`` the framework's clipping and gradient-norm logging are right.

Each variant trains two copies of one tiny model (same initial weights, same data in the same order,
same seed, dropout off) for 20 steps on the CPU: one with mixedopt.AdamW (fp16 or bf16 ``.grad``),
one with torch.optim.AdamW (lr=1e-3 both). Both sides get the same framework settings, except in
variant b, where mixedopt's side turns the framework's clipping off and clips with
``mixedopt.AdamW(..., max_grad_norm=1.0)`` while torch's side keeps the framework's clipping at 1.0.
Columns:

- norm seen: the gradient norm the framework computed from ``p.grad`` at the last step, mixedopt's
  side then torch's (Trainer: its logged ``grad_norm``; Lightning: the norm of ``p.grad`` in
  ``on_before_optimizer_step``, before clipping, as ``lightning.pytorch.utilities.grad_norm`` sees;
  accelerate: what ``accelerator.clip_grad_norm_`` returned, or, where it is not called, the
  norm of ``p.grad`` that a loop would log);
- mixedopt last_grad: ``optimizer.last_grad_norm`` (computed only with ``max_grad_norm``);
- max |w_m - w_t|: the largest absolute difference between the two models' weights after training,
  and (last column) the parameter it is in;
- max |dw_t|: the largest absolute weight change of the torch.optim model, for scale;
- warned: whether mixedopt warned that ``.grad`` was "changed in place" before ``step()``.

A variant whose training raises shows the side, the exception type and its message instead.

Needs transformers (5.x), accelerate (1.x) and lightning (2.x); not a test dependency. Run
(about 30 s on a CPU; nothing is downloaded: the models are built from configs):

    pip install transformers accelerate lightning
    python scripts/check_frameworks.py
"""

import copy
import logging
import tempfile
import warnings
from collections.abc import Callable
from typing import Any

import accelerate
import lightning as L
import torch
import transformers
from torch import nn
from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel
from transformers.trainer_callback import PrinterCallback

import mixedopt

STEPS, BATCH, LR, SEQ, VOCAB = 20, 8, 1e-3, 16, 100
BF16 = {"grad_dtype": torch.bfloat16}
# (label, mixedopt.AdamW kwargs, framework kwargs for both sides, overrides for mixedopt's side)
Variant = tuple[str, dict[str, Any], dict[str, Any], dict[str, Any]]
Trained = tuple[float | None, torch.optim.Optimizer]  # grad norm the framework saw, optimizer

HF_VARIANTS: list[Variant] = [
    ("a fp16, Trainer clips at 1", {}, {}, {}),
    ("b fp16, Trainer off, mixedopt clips", {"max_grad_norm": 1.0}, {}, {"max_grad_norm": 0}),
    ("c bf16, Trainer clips at 1", BF16, {}, {}),
    ("d bf16, Trainer clips, accumulate 2", BF16, {"gradient_accumulation_steps": 2}, {}),
    ("e bf16, Trainer clips, bf16=True", BF16, {"bf16": True}, {}),
]
CLIP, NO_CLIP = {"gradient_clip_val": 1.0}, {"gradient_clip_val": None}
LIGHTNING_VARIANTS: list[Variant] = [
    ("a fp16, clip_val=1, 32-true", {}, CLIP, {}),
    ("b fp16, clip_val=None, mixedopt clips", {"max_grad_norm": 1.0}, CLIP, NO_CLIP),
    ("c bf16, clip_val=1, 32-true", BF16, CLIP, {}),
    ("d bf16, clip_val=1, bf16-mixed", BF16, {**CLIP, "precision": "bf16-mixed"}, {}),
    ("e bf16, clip_val=1, accumulate 2", BF16, {**CLIP, "accumulate_grad_batches": 2}, {}),
]

# accelerate: clip (accelerator.clip_grad_norm_ at 1), the Accelerator's mixed_precision and
# gradient_accumulation_steps. Its fp16 mixed precision needs a GPU: not checked here.
CLIPS, NO_CLIPS = {"clip": 1.0}, {"clip": None}
ACCELERATE_VARIANTS: list[Variant] = [
    ("a fp16, clips at 1", {}, CLIPS, {}),
    ("b fp16, mixedopt clips instead", {"max_grad_norm": 1.0}, CLIPS, NO_CLIPS),
    ("c bf16, clips at 1", BF16, CLIPS, {}),
    ("d bf16, clips at 1, bf16 mixed", BF16, {**CLIPS, "mixed_precision": "bf16"}, {}),
    ("e bf16, clips at 1, accumulate 2", BF16, {**CLIPS, "accumulate": 2}, {}),
]


def tiny_bert() -> nn.Module:
    """A 2-layer BERT sequence classifier, hidden size 32, vocabulary 100."""
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=SEQ,
        num_labels=2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertForSequenceClassification(config)


def tiny_gpt2() -> nn.Module:
    """A 2-layer GPT-2 language model, hidden size 32, vocabulary 100."""
    config = GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=32,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(config)


def random_tokens(samples: int) -> torch.Tensor:
    """Random token ids, one row of SEQ per sample, the same at every call."""
    return torch.randint(0, VOCAB, (samples, SEQ), generator=torch.Generator().manual_seed(1))


def train_hf(model: nn.Module, make_optimizer: Callable, data: list, **kwargs: Any) -> Trained:
    """Train in transformers.Trainer; return its last logged grad_norm (or None), the optimizer."""
    with tempfile.TemporaryDirectory() as tmp:
        args = transformers.TrainingArguments(
            output_dir=tmp,
            max_steps=STEPS,
            per_device_train_batch_size=BATCH,
            learning_rate=LR,
            logging_steps=1,
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            seed=0,
            disable_tqdm=True,
            **kwargs,
        )
        optimizer = make_optimizer(model.parameters())
        trainer = transformers.Trainer(
            model=model, args=args, train_dataset=data, optimizers=(optimizer, None)
        )
        trainer.remove_callback(PrinterCallback)  # it prints every log line
        trainer.train()
    norms = [log["grad_norm"] for log in trainer.state.log_history if "grad_norm" in log]
    return (norms[-1] if norms else None), optimizer


class LitLM(L.LightningModule):
    """A causal LM trained on its own input ids; records the gradient norm Lightning clips by."""

    def __init__(self, model: nn.Module, make_optimizer: Callable) -> None:
        super().__init__()
        self.model, self.make_optimizer, self.grad_norm = model, make_optimizer, None

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        """The model's loss for predicting each token of the batch from the ones before."""
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """The optimizer of the side being trained."""
        return self.make_optimizer(self.parameters())

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Record the norm of p.grad: Lightning clips after this hook."""
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        self.grad_norm = torch.nn.utils.get_total_norm(grads).item()


def train_lightning(
    model: nn.Module, make_optimizer: Callable, data: torch.Tensor, **kwargs: Any
) -> Trained:
    """Train in lightning.Trainer; return the last norm of p.grad before clipping, the optimizer."""
    module = LitLM(model, make_optimizer)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(data), batch_size=BATCH, shuffle=False
    )
    trainer = L.Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )
    trainer.fit(module, loader)
    return module.grad_norm, trainer.optimizers[0]


def train_accelerate(
    model: nn.Module,
    make_optimizer: Callable,
    data: torch.Tensor,
    clip: float | None = None,
    mixed_precision: str = "no",
    accumulate: int = 1,
) -> Trained:
    """Train in a loop written on accelerate.Accelerator; return the last norm seen, the optimizer.

    The loop of accelerate's documentation: ``prepare``, ``accumulate``, ``backward``,
    ``clip_grad_norm_`` where ``clip`` is set (its return value is the norm seen), ``step``,
    ``zero_grad``. Without ``clip`` the norm seen is that of ``p.grad``, as a loop would log it.
    """
    # One Accelerator per run: its state is a process-wide singleton (Trainer made one too).
    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = accelerate.Accelerator(
        cpu=True, mixed_precision=mixed_precision, gradient_accumulation_steps=accumulate
    )
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(data[: STEPS * BATCH * accumulate]),
        batch_size=BATCH,
        shuffle=False,
    )
    optimizer = make_optimizer(model.parameters())
    model, prepared, loader = accelerator.prepare(model, optimizer, loader)
    norm = None
    for (batch,) in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(input_ids=batch, labels=batch).loss)
            if accelerator.sync_gradients:
                if clip is not None:
                    norm = accelerator.clip_grad_norm_(model.parameters(), clip)
                else:
                    grads = [p.grad for p in model.parameters() if p.grad is not None]
                    norm = torch.nn.utils.get_total_norm(grads)
            prepared.step()
            prepared.zero_grad()
    return (None if norm is None else float(norm)), optimizer


def largest_difference(a: nn.Module, b: nn.Module) -> tuple[float, str]:
    """The largest absolute difference between the weights of a and b, and its parameter's name."""
    return max(
        ((p - q).abs().max().item(), name)
        for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True)
    )


def fmt(x: float | torch.Tensor | None) -> str:
    """A number to 4 significant digits, or "-" for None."""
    return "-" if x is None else f"{float(x):.4g}"


def compare(train: Callable, make_model: Callable, data: Any, variant: Variant) -> str:
    """Train both sides of one variant from the same initial weights; return the table row."""
    label, opt_kwargs, shared, mixed_only = variant
    L.seed_everything(0, verbose=False)
    start = make_model()
    sides = {
        "mixedopt": (lambda ps: mixedopt.AdamW(ps, lr=LR, **opt_kwargs), {**shared, **mixed_only}),
        "torch": (lambda ps: torch.optim.AdamW(ps, lr=LR), shared),
    }
    models, results, warned = {}, {}, False
    for side, (make_optimizer, kwargs) in sides.items():
        models[side] = copy.deepcopy(start)
        L.seed_everything(0, verbose=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                results[side] = train(models[side], make_optimizer, data, **kwargs)
            except Exception as error:  # shown in the table, not hidden
                return f"{label:<38} {side} raised {type(error).__name__}: {error}"
        warned |= any("changed in place" in str(w.message) for w in caught)
    (norm_m, optimizer), (norm_t, _) = results["mixedopt"], results["torch"]
    difference, where = largest_difference(models["mixedopt"], models["torch"])
    change, _ = largest_difference(models["torch"], start)
    return (
        f"{label:<38} {fmt(norm_m):>9} {fmt(norm_t):>9} {fmt(optimizer.last_grad_norm):>9} "
        f"{difference:>9.2e} {change:>9.2e} {'yes' if warned else 'no':>6}  {where}"
    )


def print_table(
    title: str, train: Callable, make_model: Callable, data: Any, variants: list[Variant]
) -> None:
    """Print the header and one row per variant."""
    print(f"\n{title}")
    print(f"{'':<38} {'norm seen':>19} {'mixedopt':>9} {'max |w_m':>9} {'max':>9}")
    print(
        f"{'variant':<38} {'mixedopt':>9} {'torch':>9} {'last_grad':>9} {'- w_t|':>9} "
        f"{'|dw_t|':>9} {'warned':>6}  largest |w_m - w_t| in"
    )
    for variant in variants:
        print(compare(train, make_model, data, variant), flush=True)


def main() -> None:
    """Build the data and print both tables."""
    torch.set_num_threads(1)  # tiny models: more threads only wait for each other (10x slower)
    transformers.logging.set_verbosity_error()
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    tokens = random_tokens(2 * STEPS * BATCH)
    labels = torch.randint(0, 2, (len(tokens),), generator=torch.Generator().manual_seed(2))
    hf_data = [
        {"input_ids": t, "attention_mask": torch.ones_like(t), "labels": y}
        for t, y in zip(tokens, labels, strict=True)
    ]
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, lightning "
        f"{L.__version__}, accelerate {accelerate.__version__}; mixedopt.AdamW vs "
        f"torch.optim.AdamW (lr={LR}), {STEPS} steps, batch {BATCH}, CPU"
    )
    hf_title = "Hugging Face Trainer, tiny BERT classifier (Trainer's linear LR schedule)"
    print_table(hf_title, train_hf, tiny_bert, hf_data, HF_VARIANTS)
    lightning_title = "Lightning Trainer, tiny GPT-2 LM (norm seen: of p.grad before clipping)"
    print_table(lightning_title, train_lightning, tiny_gpt2, tokens, LIGHTNING_VARIANTS)
    accelerate_title = (
        "A loop on accelerate.Accelerator, tiny GPT-2 LM (norm seen: clip_grad_norm_'s, or of "
        "p.grad)"
    )
    print_table(accelerate_title, train_accelerate, tiny_gpt2, tokens, ACCELERATE_VARIANTS)


if __name__ == "__main__":
    main()

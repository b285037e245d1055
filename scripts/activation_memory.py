"""Activation memory against the bytes per parameter an optimizer holds, for one concrete model.

The model is a BERT-base-sized encoder built from torch.nn (12 layers, width 768, feed-forward
3072, 12 heads; about 85M parameters). One forward of --tokens tokens runs under
``torch.autocast("cpu", float16)``; a ``saved_tensors_hooks`` pair adds up the bytes of every
tensor autograd saves for backward (each storage once, the float32 weights aside), which is what
a training step holds at the peak, before backward frees it. Two forwards (--tokens and four
times as many) split it into what grows with the tokens of a step (activations) and what does
not (autocast's float16 copies of the weights, saved once per forward). The table prints
both for a few step sizes, for torch.optim.AdamW (16 bytes per parameter) and mixedopt.AdamW
(14), so that the 2 bytes per parameter mixedopt saves can be set against the whole.

    python scripts/activation_memory.py [--tokens 512] [--layers 12]

Prints the machine, the torch version and the table (docs/should-i-use-it.md quotes it).
"""

from __future__ import annotations

import argparse
import platform

import torch
from torch import nn

MIB = 2**20


def encoder(layers: int) -> nn.Module:
    """The model: an embedding and ``layers`` BERT-base-sized encoder layers."""
    layer = nn.TransformerEncoderLayer(768, 12, 3072, dropout=0.0, batch_first=True)
    return nn.Sequential(
        nn.Embedding(30522, 768), nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
    )


def saved_bytes(model: nn.Module, tokens: int) -> int:
    """Bytes autograd saves for backward in one autocast forward of ``tokens`` tokens."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    total = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal total
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        return tensor

    ids = torch.randint(0, 30522, (1, tokens))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        with torch.autocast("cpu", dtype=torch.float16):
            output = model(ids)
    del output
    return total


def main() -> None:
    """Measure, then print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=512, help="tokens of the measured forward")
    parser.add_argument("--layers", type=int, default=12, help="encoder layers")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = encoder(args.layers)
    params = sum(p.numel() for p in model.parameters())
    small, large = saved_bytes(model, args.tokens), saved_bytes(model, 4 * args.tokens)
    per_token = (large - small) / (3 * args.tokens)
    per_step = small - per_token * args.tokens
    print(f"{platform.machine()} | torch {torch.__version__}")
    print(
        f"BERT-base-sized encoder ({args.layers} layers, width 768): {params / 1e6:.1f}M "
        f"parameters. Saved for backward under autocast(float16), from forwards of "
        f"{args.tokens} and {4 * args.tokens} tokens: {per_token / 1024:.1f} KiB per token, "
        f"plus {per_step / MIB:,.0f} MiB per step ({per_step / params:.2f} B/param: the float16 "
        "copies of the weights)\n"
    )
    print(
        "| tokens per step | saved for backward (MiB) "
        "| in all, torch.optim.AdamW: + 16 B/param (MiB) "
        "| in all, mixedopt.AdamW: + 14 B/param (MiB) | mixedopt saves, of the whole |"
    )
    print("|---:|---:|---:|---:|---:|")
    for tokens in (512, 2048, 8192, 32768):
        activations = per_token * tokens + per_step
        torch_total = activations + 16 * params
        mixed_total = activations + 14 * params
        print(
            f"| {tokens:,} | {activations / MIB:,.0f} | {torch_total / MIB:,.0f} "
            f"| {mixed_total / MIB:,.0f} | {1 - mixed_total / torch_total:.1%} |"
        )


if __name__ == "__main__":
    main()

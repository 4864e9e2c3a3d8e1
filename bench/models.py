"""Workloads shared by the benchmarks: MLPs on random classification data, and a GPT-like causal LM.

The GPT-like model is the GPU workload of the GPU issue: 6 layers, d=512, 8 heads, vocab 8192, 256 tokens
(27.4M parameters), trained on random tokens; big enough that a GPU step is compute-bound.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

MLP_SIZES = {"mlp-0.1m": (64, 256, 256), "mlp-1m": (256, 1024, 768), "mlp-tiny": (8, 8, 8)}
CLASSES = 10


def mlp(name: str) -> nn.Module:
    """``mlp-0.1m`` (~0.09M parameters), ``mlp-1m`` (~1.06M), or ``mlp-tiny`` (234: a step is almost only
    Python and the data loader, so a mode's fixed cost per step shows most)."""
    inputs, h1, h2 = MLP_SIZES[name]
    return nn.Sequential(nn.Linear(inputs, h1), nn.ReLU(), nn.Linear(h1, h2), nn.ReLU(), nn.Linear(h2, CLASSES))


def mlp_data(name: str, records: int = 8192, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    inputs = MLP_SIZES[name][0]
    return TensorDataset(torch.randn(records, inputs, generator=g), torch.randint(0, CLASSES, (records,), generator=g))


class GPT(nn.Module):
    """A pre-norm causal transformer LM (torch's encoder layers with a causal mask)."""

    def __init__(self, vocab: int = 8192, d: int = 512, heads: int = 8, layers: int = 6, context: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.position = nn.Parameter(torch.zeros(context, d))
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, activation="gelu", batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        x = self.blocks(x, mask=self.mask[: tokens.shape[1], : tokens.shape[1]], is_causal=True)
        return self.head(self.norm(x))


class RandomTokens(Dataset):
    """Random token sequences; the target is the input shifted by one."""

    def __init__(self, records: int = 4096, context: int = 256, vocab: int = 8192, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, vocab, (records, context + 1), generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = self.tokens[i]
        return row[:-1], row[1:]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def workload(name: str) -> tuple[nn.Module, Dataset, str]:
    """(model, data, loss kind) for ``mlp-0.1m``, ``mlp-1m`` or ``gpt``."""
    if name == "gpt":
        return GPT(), RandomTokens(), "lm"
    return mlp(name), mlp_data(name), "classify"


def loss_of(kind: str, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return lm_loss(output, target) if kind == "lm" else nn.functional.cross_entropy(output, target)

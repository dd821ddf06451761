"""The memory on the token embeddings (MemoryLLM, FlexMemoryLLM): its query space is the vocabulary.

* `token_memory_map`: for every vocabulary token, the memory cells it activates most, per layer.
* `token_clusters`: groups of tokens that share memory cells (spherical k-means on the coefficient vectors), each
  listed with its tokens and the cells its members share.
* `layer_contributions` (every architecture): per layer, the norm of what attention, the residual FFN and the token
  memory (computed, or read from a loaded lookup table) add to the residual stream, and the memory's share.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from .arguments import (check_at_least, check_ids, check_token_list, check_token_memory_layers,
                        num_embeddings_of)
from .memory_banks import MemoryBank, decoder_of, memory_banks, model_device


def token_memory_banks(model: torch.nn.Module) -> list[MemoryBank]:
    banks = [bank for bank in memory_banks(model) if bank.context_free]
    if not banks:
        raise ValueError(f"model of class {type(model).__name__} has no memory on the token embeddings")
    return banks


@torch.no_grad()
def vocabulary_coefficients(
    model: torch.nn.Module, bank: MemoryBank, token_ids: torch.Tensor, chunk_size: int = 4096
) -> torch.Tensor:
    """`[len(token_ids), num_cells]` coefficients of tokens, computed straight from their embeddings (context-free)."""
    embed = decoder_of(model).embed_tokens
    parts = []
    for start in range(0, len(token_ids), chunk_size):
        chunk = token_ids[start : start + chunk_size].to(embed.weight.device)
        parts.append(bank.coefficients_from_input(embed(chunk)).float().cpu())
    return torch.cat(parts) if parts else torch.empty(0, bank.num_cells)


@dataclass
class TokenMemoryMap:
    """For one layer: every vocabulary token's top memory cells."""

    layer: int
    top_cells: torch.Tensor  # [vocab, k]
    top_values: torch.Tensor  # [vocab, k]

    def tokens_of_cell(self, cell: int, rank: int = 0) -> torch.Tensor:
        """Tokens whose rank-`rank` cell (0 = most activated) is `cell`."""
        return torch.nonzero(self.top_cells[:, rank] == cell).flatten()


@torch.no_grad()
def token_memory_map(
    model: torch.nn.Module, layers: Sequence[int] | None = None, top_k: int = 8, chunk_size: int = 4096,
    vocab_size: int | None = None,
) -> list[TokenMemoryMap]:
    """The token-to-memory map over the whole vocabulary: per layer, each token's `top_k` cells by coefficient.

    `vocab_size`: map the ids `0..vocab_size - 1` only, e.g. `len(tokenizer)` where the embedding has rows no token
    uses (a vocabulary padded to a round size); default: every row of the embedding."""
    check_at_least(1, top_k=top_k, chunk_size=chunk_size)
    if vocab_size is not None:
        check_at_least(1, vocab_size=vocab_size)
    banks = token_memory_banks(model)
    if layers is not None:
        check_token_memory_layers(layers, [bank.layer for bank in banks], "layers")
        banks = [bank for bank in banks if bank.layer in set(layers)]
    rows = num_embeddings_of(model)
    vocab_size = rows if vocab_size is None else min(vocab_size, rows)
    token_ids = torch.arange(vocab_size)
    maps = []
    for bank in tqdm(banks, desc="token-to-memory map", unit="layer"):
        cells, values = [], []
        for start in range(0, vocab_size, chunk_size):
            coefficients = vocabulary_coefficients(model, bank, token_ids[start : start + chunk_size], chunk_size)
            top = coefficients.topk(min(top_k, bank.num_cells), dim=-1)
            cells.append(top.indices)
            values.append(top.values)
        maps.append(TokenMemoryMap(bank.layer, torch.cat(cells), torch.cat(values)))
    return maps


MAX_CLUSTERED_TOKENS = 8192  # the vocabulary ids `token_clusters` takes by default (its first ones)


@dataclass
class TokenCluster:
    tokens: list[int]  # members, closest to the centroid first
    shared_cells: list[int]  # cells with the largest mean coefficient over the members
    shared_cell_values: list[float]
    cohesion: float  # mean cosine similarity of the members to their centroid


@torch.no_grad()
def token_clusters(
    model: torch.nn.Module,
    layer: int,
    num_clusters: int = 16,
    token_ids: torch.Tensor | None = None,
    max_tokens: int = MAX_CLUSTERED_TOKENS,
    iterations: int = 25,
    num_shared_cells: int = 5,
    seed: int = 0,
) -> list[TokenCluster]:
    """Clusters of tokens that activate the same memory cells of `layer` (cosine k-means on coefficient vectors).

    `token_ids` (a 1-D tensor of ids of the vocabulary) defaults to the first `max_tokens` ids of the vocabulary.
    Clusters are returned largest first; no tokens give no clusters. `iterations=0` keeps the initial centroids
    (tokens drawn at random).
    """
    check_at_least(1, num_clusters=num_clusters, max_tokens=max_tokens, num_shared_cells=num_shared_cells)
    check_at_least(0, iterations=iterations)
    banks = token_memory_banks(model)
    available = [bank.layer for bank in banks]
    if layer not in available:
        raise ValueError(f"layer={layer} has no token memory; allowed: {available}")
    bank = banks[available.index(layer)]
    vocab_size = num_embeddings_of(model)
    if token_ids is None:
        token_ids = torch.arange(min(vocab_size, max_tokens))
    else:
        token_ids = torch.as_tensor(token_ids, dtype=torch.long)
        if token_ids.dim() != 1:
            raise ValueError(f"token_ids has shape {tuple(token_ids.shape)}: expected a 1-D tensor of token ids")
        check_ids(token_ids.tolist(), vocab_size, "token_ids")
    if len(token_ids) == 0:
        return []
    coefficients = vocabulary_coefficients(model, bank, token_ids)
    points = torch.nn.functional.normalize(coefficients, dim=-1)
    num_clusters = min(num_clusters, len(token_ids))
    generator = torch.Generator().manual_seed(seed)
    centroids = points[torch.randperm(len(points), generator=generator)[:num_clusters]].clone()
    for _ in range(iterations):
        assignment = (points @ centroids.t()).argmax(-1)
        for c in range(num_clusters):
            members = points[assignment == c]
            if len(members):
                centroids[c] = torch.nn.functional.normalize(members.mean(0), dim=-1)
    similarity = points @ centroids.t()
    assignment = similarity.argmax(-1)
    clusters = []
    for c in range(num_clusters):
        member_index = torch.nonzero(assignment == c).flatten()
        if len(member_index) == 0:
            continue
        order = similarity[member_index, c].argsort(descending=True)
        member_index = member_index[order]
        mean = coefficients[member_index].mean(0)
        top = mean.topk(min(num_shared_cells, bank.num_cells))
        clusters.append(
            TokenCluster(
                tokens=token_ids[member_index].tolist(),
                shared_cells=top.indices.tolist(),
                shared_cell_values=top.values.tolist(),
                cohesion=float(similarity[member_index, c].mean()),
            )
        )
    return sorted(clusters, key=lambda cluster: -len(cluster.tokens))


@dataclass
class LayerContributions:
    """Mean (over tokens) norm of each component's output per layer; `memory` is the lookup-table part."""

    attention: list[float]
    ffn: list[float]  # residual FFN (FFN-C for FlexMemoryLLM); 0 where the layer has none
    memory: list[float]  # memory on X0 (MemoryLLM, FlexMemoryLLM); 0 elsewhere

    @property
    def memory_share(self) -> list[float]:
        """memory / (attention + ffn + memory) per layer."""
        return [m / max(a + f + m, 1e-30) for a, f, m in zip(self.attention, self.ffn, self.memory)]

    @property
    def ffn_share(self) -> list[float]:
        return [f / max(a + f + m, 1e-30) for a, f, m in zip(self.attention, self.ffn, self.memory)]


@torch.no_grad()
def layer_contributions(model: torch.nn.Module, token_lists: Sequence[list[int]]) -> LayerContributions:
    """Norms of the attention, FFN and token-memory outputs per layer, averaged over all tokens of `token_lists`.

    The token-memory output of layer l is what the decoder's memory readout adds to the layer (`add_into`), so it is
    measured whatever serves the memory: the memory FFN, or a loaded lookup table (also after `drop_memory_ffn`).
    """
    decoder = decoder_of(model)
    num_layers = len(decoder.layers)
    device = model_device(model)
    sums = {"attention": [0.0] * num_layers, "ffn": [0.0] * num_layers, "memory": [0.0] * num_layers}
    handles = []

    def accumulate(kind: str, layer: int):
        def hook(module, args, output):
            tensor = output[0] if isinstance(output, tuple) else output
            sums[kind][layer] += float(tensor.float().norm(dim=-1).sum())

        return hook

    for layer, block in enumerate(decoder.layers):
        handles.append(block.self_attn.register_forward_hook(accumulate("attention", layer)))
        if getattr(block, "mlp", None) is not None:
            handles.append(block.mlp.register_forward_hook(accumulate("ffn", layer)))
    num_embeddings = num_embeddings_of(model)
    num_tokens = 0
    try:
        for index, ids in enumerate(token_lists):
            check_token_list(ids, f"token_lists[{index}]")
            if not ids:
                continue
            check_ids(ids, num_embeddings, f"token_lists[{index}]")
            input_ids = torch.as_tensor(ids).reshape(1, -1).to(device)
            model(input_ids=input_ids)
            num_tokens += len(ids)
            x0 = decoder.embed_tokens(input_ids)
            readout = decoder.memory_readout(input_ids, x0) if hasattr(decoder, "memory_readout") else None
            if readout is not None:  # (None: no memory on X0)
                for layer in range(num_layers):
                    output = readout.add_into(torch.zeros_like(x0), layer)
                    sums["memory"][layer] += float(output.float().norm(dim=-1).sum())
    finally:
        for handle in handles:
            handle.remove()
    scale = 1.0 / max(num_tokens, 1)
    return LayerContributions(*([value * scale for value in sums[kind]] for kind in ("attention", "ffn", "memory")))

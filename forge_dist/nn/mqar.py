"""Synthetic multi-query associative recall (MQAR, Zoology-style), seeded and resumable.

A sequence first lists ``num_kv_pairs`` key-value pairs ``k1 v1 k2 v2 ...``, then, in a
region of filler tokens (0), asks every key once again at random places, each followed by its
value.  The model reads tokens ``seq[:-1]`` and is scored only where the next token is an
answer (a value that follows a queried key); elsewhere the label is ``-100``.

Vocabulary: 0 = filler, keys ``[1, 1 + n_keys)``, values ``[1 + n_keys, vocab_size)``.

The generator draws the *global* batch identically on every rank from one
``torch.Generator``; ranks then slice their data-parallel rows and sequence-parallel shard,
so its state (:meth:`state_dict`) is rank-independent and a checkpoint resumes at any SP/DP
split.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor


class MQAR:
    """Batches of MQAR sequences.

    Args:
        vocab_size: total vocabulary (>= 5).
        seq_len: tokens per sequence fed to the model (``T``).
        num_kv_pairs: ``P``; needs ``seq_len >= 4 P``.
        seed: seed of the generator.
        packed: yield one row of ``batch_size * seq_len`` tokens holding documents of random
            lengths in ``[4P, seq_len]`` and their global ``cu_seqlens``.
    """

    def __init__(self, vocab_size: int, seq_len: int, num_kv_pairs: int, seed: int = 0,
                 packed: bool = False):
        if vocab_size < 5:
            raise ValueError(f"vocab_size: expected at least 5, got {vocab_size}")
        self.n_keys = (vocab_size - 1) // 2
        self.n_values = vocab_size - 1 - self.n_keys
        if not 1 <= num_kv_pairs <= self.n_keys:
            raise ValueError(f"num_kv_pairs: expected 1..{self.n_keys} for vocab_size "
                             f"{vocab_size}, got {num_kv_pairs}")
        if seq_len < 4 * num_kv_pairs:
            raise ValueError(f"seq_len: expected at least 4 * num_kv_pairs = "
                             f"{4 * num_kv_pairs}, got {seq_len}")
        self.vocab_size, self.seq_len, self.P, self.packed = vocab_size, seq_len, num_kv_pairs, packed
        self.gen = torch.Generator().manual_seed(seed)

    def state_dict(self) -> dict:
        return {"generator": self.gen.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.gen.set_state(state["generator"])

    def _document(self, length: int) -> Tuple[Tensor, Tensor]:
        """One document: ``(inputs [length], labels [length])``."""
        P, g = self.P, self.gen
        seq = torch.zeros(length + 1, dtype=torch.long)
        keys = torch.randperm(self.n_keys, generator=g)[:P] + 1
        values = torch.randint(0, self.n_values, (P,), generator=g) + 1 + self.n_keys
        seq[0:2 * P:2], seq[1:2 * P:2] = keys, values
        slots = (length + 1 - 2 * P) // 2
        where = torch.randperm(slots, generator=g)[:P] * 2 + 2 * P  # query positions
        order = torch.randperm(P, generator=g)
        seq[where], seq[where + 1] = keys[order], values[order]
        inputs, targets = seq[:-1], seq[1:]
        labels = torch.full((length,), -100, dtype=torch.long)
        labels[where] = targets[where]
        return inputs, labels

    def batch(self, batch_size: int) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
        """``(input_ids, labels, cu_seqlens)``: ``[batch_size, T]`` each and ``None``, or in
        packed mode ``[1, batch_size * T]`` and the int64 offsets of the documents."""
        if not self.packed:
            docs = [self._document(self.seq_len) for _ in range(batch_size)]
            return (torch.stack([d[0] for d in docs]), torch.stack([d[1] for d in docs]), None)
        total, lo = batch_size * self.seq_len, 4 * self.P
        lengths = []
        while sum(lengths) < total:
            left = total - sum(lengths)
            n = int(torch.randint(lo, self.seq_len + 1, (1,), generator=self.gen))
            lengths.append(left if left - n < lo else n)
        docs = [self._document(n) for n in lengths]
        cu = torch.tensor([0] + lengths).cumsum(0)
        return (torch.cat([d[0] for d in docs])[None], torch.cat([d[1] for d in docs])[None],
                cu)

"""Keys/values of previously seen token sequences, reused for the longest shared prefix.

Multi-turn agents re-send the whole conversation each turn, so the next prompt extends the last
prompt + output: the finished request's entry covers it and only the new turn is prefilled.
An entry that another one extends is dropped (the longer one serves both). Memory stays bounded
by evicting least-recently-used entries once the total token count passes `max_tokens`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from itertools import count

import torch


@dataclass
class PrefixEntry:
    tokens: torch.Tensor  # [n] int64
    k: torch.Tensor  # [layers, kv_heads, n, head_dim]
    v: torch.Tensor

    def __len__(self) -> int:
        return self.tokens.shape[0]


def common_prefix_len(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(a.shape[0], b.shape[0])
    if n == 0:
        return 0
    diff = (a[:n] != b[:n]).nonzero()
    return int(diff[0, 0]) if diff.shape[0] else n


class PrefixCache:
    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._entries: OrderedDict[int, PrefixEntry] = OrderedDict()
        self._ids = count()
        self.tokens = 0
        self.lookups = 0
        self.hits = 0
        self.hit_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def _longest(self, tokens: torch.Tensor) -> tuple[int, int | None]:
        best, best_id = 0, None
        first = int(tokens[0]) if tokens.shape[0] else None
        for eid, entry in self._entries.items():
            if int(entry.tokens[0]) != first:
                continue
            n = common_prefix_len(entry.tokens, tokens)
            if n > best:
                best, best_id = n, eid
        return best, best_id

    def match(self, tokens: torch.Tensor, limit: int) -> tuple[int, torch.Tensor | None, torch.Tensor | None]:
        """Longest cached prefix of `tokens`, at most `limit` long: (n, k, v) with k/v [layers, kv, n, hd]."""
        self.lookups += 1
        if limit <= 0 or not self._entries:
            return 0, None, None
        n, eid = self._longest(tokens)
        n = min(n, limit)
        if eid is None or n == 0:
            return 0, None, None
        self._entries.move_to_end(eid)
        entry = self._entries[eid]
        self.hits += 1
        self.hit_tokens += n
        return n, entry.k[:, :, :n], entry.v[:, :, :n]

    def insert(self, tokens: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Remember keys/values (owned by the cache from now on) for `tokens`."""
        n = tokens.shape[0]
        if n == 0 or n > self.max_tokens:
            return
        for eid, entry in list(self._entries.items()):
            shared = common_prefix_len(entry.tokens, tokens)
            if shared == n:  # already covered by an equal or longer entry
                self._entries.move_to_end(eid)
                return
            if shared == len(entry):  # the new sequence extends this entry
                self._drop(eid)
        self._entries[next(self._ids)] = PrefixEntry(tokens.clone(), k, v)
        self.tokens += n
        while self.tokens > self.max_tokens:
            self._drop(next(iter(self._entries)))

    def _drop(self, eid: int) -> None:
        self.tokens -= len(self._entries.pop(eid))

    def clear(self) -> None:
        self._entries.clear()
        self.tokens = 0

    def stats(self) -> dict[str, int]:
        return {
            "entries": len(self._entries),
            "tokens": self.tokens,
            "max_tokens": self.max_tokens,
            "lookups": self.lookups,
            "hits": self.hits,
            "hit_tokens": self.hit_tokens,
        }

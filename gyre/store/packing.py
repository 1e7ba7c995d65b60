"""Pack rollouts into micro-batches by a token budget (tree tokens: shared prefixes counted once).

A micro-batch is a plain list of rollouts (each with `.tree` and `.loss_weight`, the shape of a
sampled tree) whose tree tokens add up to at most the budget; the tree packer turns it into
tensors. Greedy in arrival order, so a micro-batch is ready as soon as its rollouts have arrived.
A tree larger than the budget travels alone in a micro-batch flagged `oversize`: its tokens attend
across the whole tree, so one trainer takes it whole and trains it in segments of the budget
(gyre.train.tree_pack.pack_trees -> SplitTreeBatch, gyre/train/split_tree.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar


class HasTokens(Protocol):
    @property
    def n_tokens(self) -> int: ...


T = TypeVar("T", bound=HasTokens)


@dataclass
class MicroBatch(Generic[T]):
    items: list[T] = field(default_factory=list)
    n_tokens: int = 0
    oversize: bool = False  # one tree larger than the budget


class TokenBudgetPacker(Generic[T]):
    """Incremental packer: `add` returns the micro-batches an item completes; `flush` the last one."""

    def __init__(self, token_budget: int) -> None:
        if token_budget <= 0:
            raise ValueError(f"token_budget must be positive, got {token_budget}")
        self.token_budget = token_budget
        self._open: MicroBatch[T] = MicroBatch()

    def add(self, item: T) -> list[MicroBatch[T]]:
        n = item.n_tokens
        done: list[MicroBatch[T]] = []
        if self._open.items and self._open.n_tokens + n > self.token_budget:
            done.append(self._open)
            self._open = MicroBatch()
        if n > self.token_budget:
            done.append(MicroBatch(items=[item], n_tokens=n, oversize=True))
            return done
        self._open.items.append(item)
        self._open.n_tokens += n
        return done

    def flush(self) -> list[MicroBatch[T]]:
        done, self._open = ([self._open] if self._open.items else []), MicroBatch()
        return done


def pack_by_token_budget(items: Iterable[T], token_budget: int) -> Iterator[MicroBatch[T]]:
    packer: TokenBudgetPacker[T] = TokenBudgetPacker(token_budget)
    for item in items:
        yield from packer.add(item)
    yield from packer.flush()

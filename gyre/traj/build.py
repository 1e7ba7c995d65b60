"""A rollout's recorded calls -> its prefix-shared trajectory tree.

Calls are taken in call-id order. Each call's `input_ids + output_ids` is walked down the token trie
as far as it matches (shared prefixes are stored once), and the rest is appended as one new chain:
input tokens as context, output tokens as policy tokens with the call's behaviour logprob, id and
role. So every call ends at a node (`CallInfo.leaf`) whose root path is exactly what the engine saw
plus what it answered; compactions and sub-agents branch off wherever their prompt first differs
(often right after the system prompt, or at the root); retries and dropped replies stay as dead
branches. A token keeps the first generator and role that reached it: a policy token re-used as
context of a later call stays policy (trained once), and if a later call generates a token that
already exists as context at the same place, it becomes policy for that call. Side calls (titles,
quota probes) are never trained: their outputs are stored as context and claim nothing, so a main
call whose context runs through a side call's prompt and output trains none of those tokens.

Linear time: the trie has implicit children (node i+1 is i's child when parent[i+1] == i, which a
chain insert gives) and a dict only for branch points. Before walking token by token, a call is
compared (numpy, per contiguous run of its path) against a few earlier calls' paths: the source of
its last spliced output, the previous call and the previous call of its role. Request k+1 usually
extends one of them exactly, so the per-token walk is short.

Bad input (a whole-rollout problem raises; a one-call problem excludes that call, recorded in
`CallInfo.excluded`, `trained=False`, with its outputs stored as context so nothing of it is trained):
- a request that extends no known prefix is not an error: it starts a new root (a sub-agent with
  its own system prompt does exactly that).
- a call of another rollout, or a repeated call id: TreeError.
- a spliced span whose source call is not in the records (a call is missing; a gap in the ids is
  fine): MissingCallError, since the log is incomplete and the rollout should be excluded.
- a spliced span out of range, or not equal to its (usable) source's output ids: TreeError.
- empty input_ids: TreeError (the engine never serves an empty prompt, so the record is corrupt).
- len(output_logprobs) != len(output_ids) (truncated record): excluded ("truncated ...").
- non-finite output logprobs: excluded.
- a role not in ROLES: excluded ("unknown role ..."), recorded as role "side".
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from gyre.traj.tree import CONTEXT, ROLE_CODE, CallInfo, TrajectoryTree, TreeError


class MissingCallError(TreeError):
    """A call's prompt splices the output of a call that is not in the records."""


class SplicedLike(Protocol):
    start: int
    length: int
    source_call_id: int


class CallRecordLike(Protocol):
    rollout_id: str
    call_id: int
    input_ids: Sequence[int]
    output_ids: Sequence[int]
    output_logprobs: Sequence[float]
    spliced: Sequence[SplicedLike]
    role: str
    weight_version: str
    finish_reason: str
    t_start: float
    t_end: float
    temperature: float
    top_p: float
    top_k: int
    min_p: float


Run = tuple[int, int, int]  # (depth of the first node, first node index, length): contiguous nodes of a path


class _Nodes:
    """Growable token-level arrays plus the trie's explicit (branch-point) children."""

    def __init__(self, capacity: int) -> None:
        capacity = max(capacity, 1 << 12)
        self.n = 0
        self.tokens = np.empty(capacity, np.int32)
        self.parent = np.empty(capacity, np.int32)
        self.depth = np.empty(capacity, np.int32)
        self.policy = np.empty(capacity, bool)
        self.logprob = np.empty(capacity, np.float32)
        self.call_id = np.empty(capacity, np.int64)
        self.role = np.empty(capacity, np.uint8)
        self.branch_child: dict[tuple[int, int], int] = {}

    _ARRAYS = ("tokens", "parent", "depth", "policy", "logprob", "call_id", "role")

    def _reserve(self, extra: int) -> None:
        need = self.n + extra
        if need <= self.tokens.shape[0]:
            return
        cap = max(need, 2 * self.tokens.shape[0])
        for name in self._ARRAYS:
            old = getattr(self, name)
            new = np.empty(cap, old.dtype)
            new[: self.n] = old[: self.n]
            setattr(self, name, new)

    def child(self, node: int, token: int) -> int:
        nxt = node + 1
        if nxt < self.n and self.parent[nxt] == node and self.tokens[nxt] == token:
            return nxt
        return self.branch_child.get((node, token), -1)

    def append_chain(
        self, parent: int, first_depth: int, tokens: np.ndarray, policy: np.ndarray, logprob: np.ndarray,
        call_id: np.ndarray, role: int,
    ) -> int:  # fmt: skip
        count = tokens.shape[0]
        self._reserve(count)
        a, b = self.n, self.n + count
        self.tokens[a:b] = tokens
        self.parent[a] = parent
        self.parent[a + 1 : b] = np.arange(a, b - 1)
        self.depth[a:b] = np.arange(first_depth, first_depth + count)
        self.policy[a:b] = policy
        self.logprob[a:b] = logprob
        self.call_id[a:b] = call_id
        self.role[a:b] = role
        if a != parent + 1:
            self.branch_child[(parent, int(tokens[0]))] = a
        self.n = b
        return a


def _common_prefix(nodes: _Nodes, runs: list[Run], seq: np.ndarray) -> int:
    """Length of the common prefix of `seq` and the token path described by `runs`."""
    matched = 0
    for d0, n0, length in runs:
        if d0 >= seq.shape[0]:
            break
        m = min(length, seq.shape[0] - d0)
        differs = nodes.tokens[n0 : n0 + m] != seq[d0 : d0 + m]
        first = int(differs.argmax())  # stops at the first True
        if differs[first]:
            return d0 + first
        matched = d0 + m
        if m < length:
            break
    return matched


def _truncate(runs: list[Run], length: int) -> list[Run]:
    out = []
    for d0, n0, n in runs:
        if d0 >= length:
            break
        out.append((d0, n0, min(n, length - d0)))
    return out


def _run_nodes(runs: list[Run], lo: int, hi: int) -> np.ndarray:
    """Node indices of the path at depths [lo, hi)."""
    starts = [r[0] for r in runs]
    parts = []
    i = max(bisect.bisect_right(starts, lo) - 1, 0)
    for d0, n0, n in runs[i:]:
        if d0 >= hi:
            break
        a, b = max(lo, d0), min(hi, d0 + n)
        if a < b:
            parts.append(np.arange(n0 + a - d0, n0 + b - d0))
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def _extend_runs(runs: list[Run], depth: int, node: int, count: int) -> None:
    if runs and runs[-1][0] + runs[-1][2] == depth and runs[-1][1] + runs[-1][2] == node:
        d0, n0, n = runs[-1]
        runs[-1] = (d0, n0, n + count)
    else:
        runs.append((depth, node, count))


def _longest_match(nodes: _Nodes, candidates: list[list[Run]], seq: np.ndarray) -> tuple[list[Run], int]:
    """The path (as runs) of the longest prefix of `seq` already in the tree, and its length.

    The candidates' paths are compared first, a run at a time; the trie walk then goes on from the
    best one. Children are unique per token, so the result is the longest match whatever the candidates.
    """
    runs: list[Run] = []
    matched = 0
    for cand_runs in candidates:
        m = _common_prefix(nodes, cand_runs, seq)
        if m > matched:
            matched, runs = m, _truncate(cand_runs, m)
        if m == cand_runs[-1][0] + cand_runs[-1][2]:
            break  # extends that whole path; the walk goes on from its end
    node = runs[-1][1] + runs[-1][2] - 1 if runs else -1
    while matched < seq.shape[0]:
        nxt = nodes.child(node, int(seq[matched]))
        if nxt < 0:
            break
        _extend_runs(runs, matched, nxt, 1)
        node, matched = nxt, matched + 1
    return runs, matched


def _exclusion(call: CallRecordLike) -> str:
    if len(call.output_logprobs) != len(call.output_ids):
        return (
            f"truncated: {len(call.output_ids)} output ids but {len(call.output_logprobs)} logprobs; "
            "the call log lost part of this call"
        )
    if len(call.output_logprobs) and not np.all(np.isfinite(np.asarray(call.output_logprobs, np.float64))):
        return "non-finite output logprobs"
    if call.role not in ROLE_CODE:
        return f"unknown role {call.role!r} (known: {', '.join(ROLE_CODE)}); treated as 'side'"
    return ""


def _check_records(rollout_id: str, calls: Sequence[CallRecordLike]) -> None:
    by_id: dict[int, CallRecordLike] = {}
    for c in calls:
        if c.rollout_id != rollout_id:
            raise TreeError(f"call {c.call_id} belongs to rollout {c.rollout_id!r}, not {rollout_id!r}")
        if c.call_id in by_id:
            raise TreeError(f"rollout {rollout_id!r}: call id {c.call_id} appears twice in the call log")
        by_id[c.call_id] = c
        if len(c.input_ids) == 0:
            raise TreeError(f"rollout {rollout_id!r}: call {c.call_id} has no input ids; the record is corrupt")
    for c in calls:
        for span in c.spliced:
            if span.source_call_id not in by_id:
                raise MissingCallError(
                    f"rollout {rollout_id!r}: call {c.call_id} splices the output of call {span.source_call_id}, "
                    "which is not in the call log; the log is incomplete, exclude this rollout"
                )
            if span.start < 0 or span.start + span.length > len(c.input_ids):
                raise TreeError(
                    f"rollout {rollout_id!r}: call {c.call_id} has a spliced span [{span.start}, "
                    f"{span.start + span.length}) outside its {len(c.input_ids)} input ids"
                )


class _TreeBuilder:
    def __init__(self, capacity: int) -> None:
        self.nodes = _Nodes(capacity)
        self.paths: dict[int, list[Run]] = {}  # call id -> its root-to-leaf path
        self.last_of_role: dict[str, int] = {}
        self.previous: int | None = None
        self.outputs: dict[int, np.ndarray] = {}  # usable calls' output ids, to check splices against

    def check_spliced(self, call: CallRecordLike, input_ids: np.ndarray) -> None:
        for span in call.spliced:
            source = self.outputs.get(span.source_call_id)
            if source is None:
                continue  # an excluded call: its output ids may be the truncated part
            if not np.array_equal(input_ids[span.start : span.start + span.length], source):
                raise TreeError(
                    f"rollout {call.rollout_id!r}: call {call.call_id}'s spliced span at {span.start} is not call "
                    f"{span.source_call_id}'s output ids; the proxy's splice record is inconsistent"
                )

    def add(self, call: CallRecordLike, role: str, usable: bool) -> int:
        """Insert one call's input + output; returns its leaf. A usable non-side call's outputs are policy tokens."""
        nodes, n_in = self.nodes, len(call.input_ids)
        output_ids = np.asarray(call.output_ids, np.int32)
        seq = np.concatenate([np.asarray(call.input_ids, np.int32), output_ids])
        self.check_spliced(call, seq[:n_in])
        if usable:
            self.outputs[call.call_id] = output_ids
        trainable = usable and role != "side"
        candidates = [max(call.spliced, key=lambda s: s.start).source_call_id] if call.spliced else []
        candidates += [c for c in (self.previous, self.last_of_role.get(role)) if c is not None]
        runs, matched = _longest_match(
            nodes, [self.paths[c] for c in dict.fromkeys(candidates) if c in self.paths], seq
        )
        logprobs = np.zeros(seq.shape[0], np.float32)
        if trainable:
            logprobs[n_in:] = np.asarray(call.output_logprobs, np.float32)
        if trainable and matched > n_in:  # generated tokens that already exist: claim the context ones
            shared = _run_nodes(runs, n_in, matched)
            claim = shared[~nodes.policy[shared]]
            nodes.policy[claim] = True
            nodes.logprob[claim] = logprobs[nodes.depth[claim]]
            nodes.call_id[claim] = call.call_id
        if matched < seq.shape[0]:
            is_policy = (np.arange(matched, seq.shape[0]) >= n_in) & trainable
            first = nodes.append_chain(
                parent=runs[-1][1] + runs[-1][2] - 1 if runs else -1,
                first_depth=matched,
                tokens=seq[matched:],
                policy=is_policy,
                logprob=logprobs[matched:],
                call_id=np.where(is_policy, call.call_id, CONTEXT),
                role=ROLE_CODE[role],
            )
            _extend_runs(runs, matched, first, seq.shape[0] - matched)
        self.paths[call.call_id] = runs
        self.previous = self.last_of_role[role] = call.call_id
        return runs[-1][1] + runs[-1][2] - 1

    def routed_experts(self, calls: Sequence[CallRecordLike]) -> np.ndarray | None:
        """[N, MoE layers, top-k] int16: each token's experts from the first call (in call order) whose engine ran
        it; -1 where none did (a leaf's last token). None when no call recorded any (rl.routing_replay off)."""
        recorded = [(c, rows) for c in calls if (rows := _routing_rows(c)) is not None]
        if not recorded:
            return None
        shape = recorded[0][1].shape[1:]
        routed = np.full((self.nodes.n, *shape), -1, np.int16)
        filled = np.zeros(self.nodes.n, bool)
        for call, rows in recorded:
            if rows.shape[1:] != shape:
                raise TreeError(f"rollout {call.rollout_id!r}: call {call.call_id}'s routed experts are "
                                f"[positions, {', '.join(map(str, rows.shape[1:]))}], an earlier call's "
                                f"[positions, {', '.join(map(str, shape))}]")  # fmt: skip
            nodes = _run_nodes(self.paths[call.call_id], 0, rows.shape[0])
            fresh = ~filled[nodes]
            routed[nodes[fresh]] = rows[: nodes.shape[0]][fresh]
            filled[nodes] = True
        return routed

    def tree(self, rollout_id: str, calls: list[CallInfo]) -> TrajectoryTree:
        nd, n = self.nodes, self.nodes.n
        return TrajectoryTree(
            rollout_id=rollout_id,
            tokens=nd.tokens[:n].copy(),
            parent=nd.parent[:n].copy(),
            depth=nd.depth[:n].copy(),
            policy=nd.policy[:n].copy(),
            logprob=nd.logprob[:n].copy(),
            call_id=nd.call_id[:n].copy(),
            role=nd.role[:n].copy(),
            calls=calls,
        )


def build_tree(rollout_id: str, calls: Sequence[CallRecordLike]) -> TrajectoryTree:
    """One rollout's calls (any order) -> its TrajectoryTree; see the module docstring for bad input."""
    ordered = sorted(calls, key=lambda c: c.call_id)
    excluded = {c.call_id: _exclusion(c) for c in ordered}
    _check_records(rollout_id, ordered)
    builder = _TreeBuilder(capacity=max((len(c.input_ids) + len(c.output_ids) for c in ordered), default=0))
    infos = []
    for call in ordered:
        reason = excluded[call.call_id]
        role = call.role if call.role in ROLE_CODE else "side"
        leaf = builder.add(call, role, usable=not reason)
        infos.append(
            CallInfo(
                call_id=call.call_id,
                role=role,
                leaf=leaf,
                n_input=len(call.input_ids),
                n_output=len(call.output_ids),
                weight_version=call.weight_version,
                finish_reason=call.finish_reason,
                t_start=call.t_start,
                t_end=call.t_end,
                trained=not reason and role != "side",
                excluded=reason,
                temperature=call.temperature,
                top_p=call.top_p,
                top_k=call.top_k,
                min_p=call.min_p,
            )
        )
    tree = builder.tree(rollout_id, infos)
    tree.routed_experts = builder.routed_experts(ordered)
    return tree


def _routing_rows(call: CallRecordLike) -> np.ndarray | None:
    """A call's recorded routed experts [positions, MoE layers, top-k] (gyre.proxy.call_log.CallRecord's), if any."""
    rows = getattr(call, "routed_experts_rows", None)
    return rows() if rows is not None else None

"""Serving rollouts for one cell: its engine, the proxy in front of it, and the harness processes.

`collect(step)` runs `groups_per_step` groups of `group_size` rollouts of the same task through
the black-box harness, grades each preserved workspace, writes each group's shard the moment the
group completes (gyre/pipeline.py turns its calls into trees), and hands back each rollout's
recorded calls. A resumed run's first step restores the groups kept from the interrupted start
(gyre.resume.kept_groups) instead of running them.
"""

from __future__ import annotations

import asyncio
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gyre.config.schema import LogprobDistribution, RunConfig
from gyre.engine.engine import EngineSetup, RolloutEngine, make_engine
from gyre.engine.switch import join_rollout, leave_rollout
from gyre.harness.runner import RolloutOutcome, run_rollouts
from gyre.health import count_reasons
from gyre.metrics import mean
from gyre.pipeline import FinishedRollout, GroupShard, write_group_shard
from gyre.proxy.call_log import CallLog
from gyre.proxy.keys import RolloutKeys
from gyre.proxy.server import ProxyServer
from gyre.resume.kept_groups import KeptGroup, restore_groups
from gyre.sandbox import make_sandbox
from gyre.sandbox.backends import check_task_images
from gyre.tasks.suite import TaskPool
from gyre.warm_start import Policy


@dataclass
class StepRollouts:
    outcomes: list[RolloutOutcome]
    finished: list[FinishedRollout]
    n_calls: int
    policy_tokens: int
    shards: list[GroupShard] = field(default_factory=list)  # one per group, by group
    kept_groups: list[int] = field(default_factory=list)  # restored from an interrupted start, not run again

    def groups(self) -> dict[int, list[FinishedRollout]]:
        out: dict[int, list[FinishedRollout]] = {}
        for r in self.finished:
            out.setdefault(r.group, []).append(r)
        return out

    def summary(self) -> dict[str, Any]:
        graded = [o for o in self.outcomes if o.grade.status != "failed"]
        return {
            "n_rollouts": len(self.outcomes),
            "n_scored": len(graded),
            "n_excluded": len(self.outcomes) - len(graded),
            "n_timeouts": sum(1 for o in self.outcomes if o.grade.status == "timeout"),
            "reward_mean": mean([o.grade.score for o in graded]),
            "success_rate": mean([1.0 if o.grade.success else 0.0 for o in graded]),
            "turns_mean": mean([float(o.turns) for o in self.outcomes]),
            "turns_max": max((o.turns for o in self.outcomes), default=0),
            "rollout_wall_max_s": max((o.wall_s for o in self.outcomes), default=0.0),
            "n_calls": self.n_calls,
            "policy_tokens": self.policy_tokens,
            "excluded_reasons": sorted({o.grade.reason for o in self.outcomes if o.grade.status == "failed"}),
            "excluded_reason_counts": count_reasons(
                o.grade.reason for o in self.outcomes if o.grade.status == "failed"
            ),
            "n_agent_failed": sum(1 for o in self.outcomes if o.grade.status == "agent_failed"),
            "kept_groups": self.kept_groups,
        }


class RolloutService:
    def __init__(
        self, cfg: RunConfig, policy: Policy, output_dir: Path, kept: dict[int, KeptGroup] | None = None
    ) -> None:
        self.cfg = cfg
        self.kept = kept or {}  # groups of the first step this start runs, kept from the interrupted one
        self.policy = policy
        self.out = output_dir
        self.tokenizer = policy.tokenizer()
        self.call_log = CallLog(output_dir / "calls.jsonl")
        self.task_pool = TaskPool.from_config(cfg.tasks, seed=cfg.seed)
        setup = EngineSetup(policy.model_cfg, policy.tokenizer_dir, output_dir, scratch=output_dir / "weights")
        self.engine: RolloutEngine = make_engine(cfg.engine, setup)
        self.proxy = None
        self.keys = RolloutKeys()
        self.sandbox = make_sandbox(cfg.sandbox)  # fails before the engine starts when it cannot run here
        check_task_images(cfg.sandbox, [t.image for t in self.task_pool.tasks])

    def __enter__(self) -> RolloutService:
        self.engine.start(self.policy.checkpoint_dir)
        truncated = self.cfg.rl.logprob_distribution is LogprobDistribution.truncated
        self.proxy = ProxyServer(
            self.tokenizer,
            self.engine.urls,
            self.cfg.proxy,
            self.call_log,
            truncated_logprobs=truncated,
            keys=self.keys,
        )
        self.proxy_url = self.proxy.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        self.engine.stop()

    def collect(self, step: int) -> StepRollouts:
        rl = self.cfg.rl
        tasks = self.task_pool.for_step(step, rl.groups_per_step)
        kept = restore_groups({g: k for g, k in self.kept.items() if k.step == step}, tasks, self.out)
        jobs = [
            (g, t, f"s{step}-g{g}-r{i}") for g, t in enumerate(tasks) if g not in kept for i in range(rl.group_size)
        ]
        groups = {g: list(r.members) for g, r in kept.items()}
        shards = {g: r.shard for g, r in kept.items()}
        (self.out / "shards").mkdir(parents=True, exist_ok=True)

        def done(index: int, outcome: RolloutOutcome) -> None:  # a group's shard as soon as the group is complete
            group, _, rid = jobs[index]
            members = groups.setdefault(group, [])
            members.append(FinishedRollout(group, outcome, self.call_log.pop_rollout(rid)))
            if len(members) == rl.group_size:
                members.sort(key=lambda r: r.outcome.rollout_id)
                skipped = self.task_pool.skipped_causes()
                shards[group] = write_group_shard(self.cfg, self.out / "shards", step, group, members, skipped)

        workdir = self.out / "rollouts" / f"step{step:04d}"
        asyncio.run(
            run_rollouts(
                [(t, rid) for _, t, rid in jobs],
                self.proxy_url,
                workdir,
                self.cfg.harness,
                self.cfg.tasks,
                sandbox=self.sandbox,
                keys=self.keys,
                on_done=done,
            )  # fmt: skip
        )
        finished = [r for g in sorted(groups) for r in groups[g]]
        n_calls = sum(len(r.calls) for r in finished)
        policy_tokens = sum(len(c.output_ids) for r in finished for c in r.calls)
        if not self.cfg.harness.keep_workspaces:
            shutil.rmtree(workdir, ignore_errors=True)
        outcomes = [r.outcome for r in finished]
        return StepRollouts(
            outcomes, finished, n_calls, policy_tokens, [shards[g] for g in sorted(shards)], sorted(kept)
        )

    def release_engines(self) -> None:
        """Colocate: the engine gives its memory to training until the next weights arrive."""
        leave_rollout(self.engine)

    def sync_weights(self, hf_state: dict[str, torch.Tensor], version: int) -> None:
        """After training: the engine takes its memory back with the new weights and serves again."""
        join_rollout(self.engine, lambda: self.engine.update_weights(hf_state, str(version)))

    def load_weights(self, hf_state: dict[str, torch.Tensor], version: int) -> None:
        """While serving (a resumed run's first weights)."""
        self.engine.update_weights(hf_state, str(version))

"""The starting policy: a tokenizer trained on the task suite's text and a short SFT on demonstrations.

Both are cached under `warm_start.cache_dir`, keyed by everything that shapes them, so a second
run starts at once. The cache entry is written to a temp directory and renamed into place.

A bootstrap stage above the trainer, the harness kinds and the tasks it draws on (its demonstrations are a
harness's requests on the suite's tasks), below the loops that start from its Policy.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from gyre.config.schema import ModelConfig, ModelInit, RunConfig
from gyre.fsutil import locked
from gyre.harness.demos import Demonstration, tokenizer_corpus
from gyre.harness.kinds import harness_spec
from gyre.model.chat_template import AssistantTurn, assistant_body, render_segments, render_text
from gyre.model.hf_io import load_hf_state, save_hf_checkpoint
from gyre.model.llama import LlamaForCausalLM
from gyre.model.pretrained import pretrained_model_config
from gyre.model.tokenizer import Tokenizer
from gyre.tasks.suite import sample_tasks
from gyre.tasks.task import Task
from gyre.train.trainer import Trainer, make_trainer

WARM_START_VERSION = 3
SFT_SEED_OFFSET = 1_000_003  # demonstrations come from other task instances than RL's
DEMO_EPOCH = datetime.date(2026, 1, 1)


@dataclass
class Policy:
    model_cfg: ModelConfig
    tokenizer_dir: Path
    checkpoint_dir: Path

    def load_state(self) -> dict[str, torch.Tensor]:
        return load_hf_state(self.checkpoint_dir)[1]

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.load(self.tokenizer_dir)


@dataclass
class SFTBatch:
    tokens: torch.Tensor  # [B, T], several conversations packed per row
    loss_mask: torch.Tensor  # [B, T-1], 1 where tokens[:, 1:] is an assistant token
    attention_mask: torch.Tensor  # [B, 1, T, T], True = masked: causal within each packed conversation


def cache_key(cfg: RunConfig) -> str:
    ws = dataclasses.asdict(cfg.warm_start)
    ws.pop("cache_dir")
    blob = {
        "v": WARM_START_VERSION,
        # model.path / chat_template: no warm start at all (prepare_policy); left out, earlier keys stay valid
        "model": {k: v for k, v in dataclasses.asdict(cfg.model).items() if k not in ("path", "chat_template")},
        "tokenizer": dataclasses.asdict(cfg.tokenizer),
        "families": list(cfg.tasks.families),
        "warm_start": ws,
        "optimizer": [cfg.train.grad_clip, cfg.train.adam_beta2, cfg.train.weight_decay],
        # what the task suite, harness tools and chat template render to: any change there retrains
        "harness": [cfg.harness.kind, cfg.harness.bare],
        "suite": hashlib.sha256(
            "".join(
                render_text(*harness_demo(cfg, t, 0)) for t in sample_tasks(demo_families(cfg), 32, seed=0)
            ).encode()
        ).hexdigest(),
    }
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:16]


def demo_families(cfg: RunConfig) -> list[str]:
    return list(cfg.warm_start.families or cfg.tasks.families)


def harness_demo(cfg: RunConfig, task: Task, i: int) -> Demonstration:
    """Demonstration `i` in the configured harness's own format; Claude Code's prompt names the day, so
    demonstrations name days of a year (the policy learns to ignore it), the first the cache key's."""
    date = (DEMO_EPOCH + datetime.timedelta(days=i % 365)).isoformat()
    return harness_spec(cfg.harness.kind).demonstration(task, bare=cfg.harness.bare, date=date)


def harness_corpus(cfg: RunConfig) -> list[str]:
    """The tokenizer's corpus: the built-in suite's demonstrations, and the harness's own if it has others
    (Claude Code's prompt would otherwise tokenize at about one character a token)."""
    texts = list(tokenizer_corpus(cfg.tokenizer.corpus_tasks, cfg.model.seed, cfg.tasks.families))
    if harness_spec(cfg.harness.kind).demos_in_corpus:
        tasks = sample_tasks(demo_families(cfg), max(1, cfg.tokenizer.corpus_tasks // 4), cfg.model.seed + 7)
        texts += [render_text(*harness_demo(cfg, t, i)) for i, t in enumerate(tasks)]
    return texts


def prepare_policy(
    cfg: RunConfig, log: Callable[[str], None] = print, check: Callable[[Tokenizer], object] | None = None
) -> Policy:
    """The cached warm start, or a new one; `check` sees the tokenizer before any training (a preflight).
    With model.path the directory is the policy as it is: no tokenizer training, no init, no SFT."""
    if cfg.model.path:
        return pretrained_policy(cfg, log, check)
    root = Path(os.path.expanduser(cfg.warm_start.cache_dir)) / f"policy-{cache_key(cfg)}"
    if not (root / "meta.json").exists():
        root.parent.mkdir(parents=True, exist_ok=True)
        # one build of a warm start at a time (a sweep's jobs start together on an empty cache): the others wait
        # for it and reuse it, instead of each building the same and replacing the one another run is loading
        waiting = lambda: log(f"gyre: another run is building the warm start {root}; waiting for it")  # noqa: E731
        with locked(root.with_name(f".{root.name}.lock"), waiting):
            if not (root / "meta.json").exists():
                return _build_policy(cfg, root, log, check)
    log(f"gyre: reusing cached warm start {root}")
    policy = _policy_at(root)
    if check is not None:
        check(policy.tokenizer())
    return policy


def _build_policy(
    cfg: RunConfig, root: Path, log: Callable[[str], None], check: Callable[[Tokenizer], object] | None
) -> Policy:
    tmp = root.with_name(root.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    log(f"gyre: building tokenizer and warm start in {root}")
    try:
        _build_into(cfg, tmp, log, check)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a refused preflight or a stop leaves no partial build behind
        raise
    shutil.rmtree(root, ignore_errors=True)  # an entry without meta.json: never finished
    tmp.rename(root)
    return _policy_at(root)


def _build_into(
    cfg: RunConfig, tmp: Path, log: Callable[[str], None], check: Callable[[Tokenizer], object] | None
) -> None:
    """The tokenizer, the warm-started checkpoint and meta.json (written last: a finished entry) in `tmp`."""
    tokenizer = Tokenizer.train(harness_corpus(cfg), cfg.tokenizer.vocab_size)
    if check is not None:
        check(tokenizer)
    tokenizer.save(tmp / "tokenizer")
    model_cfg = dataclasses.replace(cfg.model, vocab_size=tokenizer.vocab_size)
    # one process (rank 0 of the cell job, before the cells' trainer worlds exist); the cells shard what it writes
    one_process = {"tensor_parallel": 1, "pipeline_parallel": 1, "context_parallel": 1}
    trainer = make_trainer(model_cfg, dataclasses.replace(cfg.train, lr=cfg.warm_start.lr, **one_process))
    if cfg.model.init == ModelInit.torch:
        trainer.load_hf_state_dict(torch_default_init(model_cfg))
    losses: list[float] = []
    if cfg.warm_start.enabled and cfg.warm_start.steps > 0:
        examples = sft_examples(cfg, tokenizer)
        losses = run_sft(trainer, examples, cfg, tokenizer.pad_id, log)
    save_hf_checkpoint(tmp / "checkpoint", trainer.hf_state_dict(), model_cfg, tmp / "tokenizer")
    meta = {"model": dataclasses.asdict(model_cfg), "sft_losses": losses[-20:], "key": cache_key(cfg)}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2))


def pretrained_policy(
    cfg: RunConfig, log: Callable[[str], None], check: Callable[[Tokenizer], object] | None
) -> Policy:
    """model.path as it is (checked against the run before anything starts: launch.run.check_before_start)."""
    model_cfg = pretrained_model_config(cfg.model)
    policy = Policy(model_cfg, Path(model_cfg.path), Path(model_cfg.path))
    if check is not None:
        check(policy.tokenizer())
    log(f"gyre: starting from the model in {model_cfg.path} (no warm start)")
    return policy


def torch_default_init(model_cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Weights as PyTorch's module defaults initialise them (embeddings N(0, 1), linears Kaiming-uniform).

    Measured on the built-in suite: from megatron's N(0, 0.02) init the warm start had copied no
    value correctly after 200 steps; from this init it had 28% of write_value demos exact.
    """
    torch.manual_seed(model_cfg.seed)
    return LlamaForCausalLM(model_cfg).state_dict()


def _policy_at(root: Path) -> Policy:
    meta = json.loads((root / "meta.json").read_text())
    return Policy(ModelConfig(**meta["model"]), root / "tokenizer", root / "checkpoint")


def encode_conversation(
    messages: list[dict], tools: list[dict] | None, tokenizer: Tokenizer
) -> tuple[list[int], list[int]]:
    """Token ids of a whole conversation and a mask that is 1 on assistant-generated tokens."""
    ids: list[int] = []
    mask: list[int] = []
    for seg in render_segments(messages, tools, add_generation_prompt=False):
        if isinstance(seg, AssistantTurn):
            part = tokenizer.encode(assistant_body(seg.message))
            mask += [1] * len(part)
        else:
            part = tokenizer.encode(seg)
            mask += [0] * len(part)
        ids += part
    return ids, mask


def sft_examples(cfg: RunConfig, tokenizer: Tokenizer) -> list[tuple[list[int], list[int]]]:
    tasks = sample_tasks(demo_families(cfg), cfg.warm_start.demos, seed=cfg.model.seed + SFT_SEED_OFFSET)
    return [encode_conversation(*harness_demo(cfg, task, i), tokenizer) for i, task in enumerate(tasks)]


def pack_batch(examples: list[tuple[list[int], list[int]]], row_tokens: int, pad_id: int) -> SFTBatch:
    """Pack conversations into rows of at most `row_tokens` (longer ones get a row of their own).

    Each token attends causally within its own conversation only; RoPE depends on relative
    positions alone, so a packed conversation computes exactly what it would on its own row.
    """
    rows: list[list[tuple[list[int], list[int]]]] = []
    for ex in sorted(examples, key=lambda e: -len(e[0])):
        for row in rows:
            if sum(len(ids) for ids, _ in row) + len(ex[0]) <= row_tokens:
                row.append(ex)
                break
        else:
            rows.append([ex])
    t = max(sum(len(ids) for ids, _ in row) for row in rows)
    tokens = torch.full((len(rows), t), pad_id, dtype=torch.long)
    loss_mask = torch.zeros(len(rows), t - 1)
    allowed = torch.zeros(len(rows), t, t, dtype=torch.bool)
    for r, row in enumerate(rows):
        pos = 0
        for ids, mask in row:
            n = len(ids)
            tokens[r, pos : pos + n] = torch.tensor(ids)
            loss_mask[r, pos : pos + n - 1] = torch.tensor(mask[1:], dtype=torch.float32)
            allowed[r, pos : pos + n, pos : pos + n] = torch.ones(n, n, dtype=torch.bool).tril()
            pos += n
        allowed[r, pos:, pos:] = torch.ones(t - pos, t - pos, dtype=torch.bool).tril()  # padding
    return SFTBatch(tokens, loss_mask, ~allowed[:, None])


def sft_loss(logp: torch.Tensor, batch: SFTBatch) -> tuple[torch.Tensor, dict[str, float]]:
    n = batch.loss_mask.sum().clamp(min=1.0)
    loss = -(logp * batch.loss_mask).sum() / n
    return loss, {"sft_loss": float(loss.detach())}


def run_sft(
    trainer: Trainer,
    examples: list[tuple[list[int], list[int]]],
    cfg: RunConfig,
    pad_id: int,
    log: Callable[[str], None],
) -> list[float]:
    from tqdm import tqdm

    rng = random.Random(cfg.seed)
    ws = cfg.warm_start
    losses = []
    bar = tqdm(range(ws.steps), desc="warm start (SFT)", unit="step", dynamic_ncols=True)
    for step in bar:
        trainer.set_lr(ws.lr * min(1.0, (step + 1) / 20))  # constant after warm-up: no decay before RL
        batch = pack_batch(rng.sample(examples, min(ws.batch_size, len(examples))), ws.pack_tokens, pad_id)
        metrics = trainer.train_step([batch], sft_loss)
        losses.append(metrics["sft_loss"])
        bar.set_postfix(loss=f"{metrics['sft_loss']:.3f}")
    log(f"gyre: warm start done, final SFT loss {sum(losses[-10:]) / max(len(losses[-10:]), 1):.3f}")
    return losses

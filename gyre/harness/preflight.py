"""Before the first step: can the chosen model serve the chosen harness at all?

A harness whose first request alone (its system prompt, tool list and task, rendered as the proxy
renders it, tokenized by the policy's tokenizer) plus one reply does not fit the context gets nothing
but "prompt is too long" from the proxy: every rollout of the run would fail. This fails first, naming
the keys to change.
"""

from __future__ import annotations

from gyre.config.schema import RunConfig
from gyre.config.validate import ConfigValueError
from gyre.harness.kinds import harness_spec
from gyre.model.chat_template import render_text
from gyre.model.tokenizer import Tokenizer
from gyre.tasks.task import Task


def context_limit(cfg: RunConfig) -> int:
    return min(cfg.engine.max_context_tokens, cfg.proxy.max_context_tokens, cfg.model.max_position_embeddings)


def reply_budget(cfg: RunConfig) -> int:
    """Tokens one reply may take: the proxy's cap, else what the harness asks for (Claude Code asks for 64000)."""
    if cfg.proxy.max_output_tokens is not None:
        return cfg.proxy.max_output_tokens
    return cfg.proxy.default_max_tokens if harness_spec(cfg.harness.kind).own_max_tokens else cfg.harness.max_tokens


def first_request_tokens(cfg: RunConfig, task: Task, tokenizer: Tokenizer) -> int:
    demo = harness_spec(cfg.harness.kind).first_request(task, bare=cfg.harness.bare)
    return len(tokenizer.encode(render_text(demo.messages, demo.tools)))


def check_harness_fits(cfg: RunConfig, tasks: list[Task], tokenizer: Tokenizer) -> int:
    """Raise ConfigValueError when the longest first request of `tasks` plus one reply exceeds the context;
    returns that request's token count."""
    prompt = max(first_request_tokens(cfg, t, tokenizer) for t in tasks)
    need, limit = prompt + reply_budget(cfg), context_limit(cfg)
    if need > limit:
        short = harness_spec(cfg.harness.kind).short_prompt and not cfg.harness.bare
        bare = " or harness.bare=true (the harness's short prompt)" if short else ""
        raise ConfigValueError(
            f"harness.kind={cfg.harness.kind!r}: its first request is {prompt} tokens, plus a reply of "
            f"{reply_budget(cfg)} (proxy.max_output_tokens), {need} > the context of {limit} tokens "
            f"(engine.max_context_tokens={cfg.engine.max_context_tokens}, proxy.max_context_tokens="
            f"{cfg.proxy.max_context_tokens}, model.max_position_embeddings={cfg.model.max_position_embeddings}): "
            f"raise those, lower proxy.max_output_tokens{bare}, or pick a preset that fits "
            f"(harness=builtin|claude_code|mini_swe_agent|codex)"
        )
    return prompt

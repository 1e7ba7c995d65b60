"""Codex CLI (npm `@openai/codex`, a native binary in the package) as a black-box harness against the proxy.

`codex exec` runs one session non-interactively on a model provider that is the proxy's Responses API
(`wire_api = "responses"`, the rollout id in the base-URL path), with a private CODEX_HOME (no login: the
key comes from GYRE_API_KEY), no update check or analytics, and its own sandbox off (it runs inside
Gyre's). What the proxy cannot serve is switched off rather than refused on every call: the hosted
web_search tool, the multi-agent tools (sent as a `namespace` tool), goals and image generation.
Not yet a harness kind of the runner: this module holds the command line the test drives the real CLI with.
"""

from __future__ import annotations

import os
from pathlib import Path

CODEX_VERSION = "0.171.0"  # the npm version tools/setup_env.sh installs and the tests ran against
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_BIN = REPO_ROOT / ".gyre" / "node" / "node_modules" / ".bin" / "codex"
DISABLED_FEATURES = ("multi_agent", "goals", "image_generation")
PROVIDER = "gyre"


def codex_bin() -> Path:
    path = Path(os.environ.get("GYRE_CODEX_BIN") or DEFAULT_BIN)
    if not path.exists():
        raise FileNotFoundError(
            f"Codex CLI not found at {path}; run `bash tools/setup_env.sh` (needs node and npm) or set GYRE_CODEX_BIN"
        )
    return path


def responses_base_url(proxy_url: str, rollout_id: str) -> str:
    """`http://host:port[/v1]` -> `http://host:port/rollout/<id>/v1` (Codex appends /responses)."""
    url = proxy_url.rstrip("/").removesuffix("/v1")
    return f"{url}/v1" if "/rollout/" in url else f"{url}/rollout/{rollout_id}/v1"


def codex_config(base_url: str, instructions_file: Path | None = None) -> dict[str, str]:
    """`-c key=value` overrides (values in TOML): the proxy as the only model provider, nothing else on."""
    provider = f"model_providers.{PROVIDER}"
    config = {
        "model_provider": f'"{PROVIDER}"',
        f"{provider}.name": f'"{PROVIDER}"',
        f"{provider}.base_url": f'"{base_url}"',
        f"{provider}.wire_api": '"responses"',
        f"{provider}.env_key": '"GYRE_API_KEY"',
        f"{provider}.request_max_retries": "0",  # the proxy retries engines itself; a 5xx here is final
        f"{provider}.stream_max_retries": "0",
        "check_for_update_on_startup": "false",
        "analytics.enabled": "false",
        "web_search": '"disabled"',  # a hosted tool: the proxy has no search to run, and refuses it
        "include_permissions_instructions": "false",
        "skills.bundled.enabled": "false",
    }
    if instructions_file is not None:  # replaces Codex's ~17 KB of base instructions
        config["model_instructions_file"] = f'"{instructions_file}"'
    return config


def codex_exec_args(base_url: str, workspace: Path, model: str, instructions_file: Path | None = None) -> list[str]:
    """`codex exec` in `workspace`, approvals and Codex's own sandbox off (Gyre's sandbox holds it)."""
    overrides = [arg for k, v in codex_config(base_url, instructions_file).items() for arg in ("-c", f"{k}={v}")]
    disabled = [arg for feature in DISABLED_FEATURES for arg in ("--disable", feature)]
    return [
        str(codex_bin()), "exec", *overrides, *disabled, "-m", model, "--skip-git-repo-check",
        "--dangerously-bypass-approvals-and-sandbox", "-C", str(workspace),
    ]  # fmt: skip


def codex_env(home: Path, api_key: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """A private HOME/CODEX_HOME (no login, no earlier sessions) and no proxy variables."""
    source = os.environ if base is None else base
    env = {k: v for k, v in source.items() if k in ("PATH", "LANG", "TERM", "TMPDIR")}
    env.update(HOME=str(home), CODEX_HOME=str(home), GYRE_API_KEY=api_key, NO_PROXY="127.0.0.1,localhost")
    return env

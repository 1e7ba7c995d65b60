"""Vocabulary the built-in task families draw their instances from: short, common, single-token."""

from __future__ import annotations

# 64 words: each must be copied from the prompt into a tool call, and a ~1M-parameter model learns
# that per token, so a longer list makes the warm start slower (measured: 48 words reach the copy
# phase change ~25% sooner than 176).
WORDS: tuple[str, ...] = tuple(
    """
    apple bread chair cloud dance eagle flame grape house juice knife lemon money night ocean piano
    queen river stone table voice water zebra beach candy earth fruit ghost honey jelly mango olive
    pearl robin sugar tiger wheat cabin medal pilot salad torch wagon pixel frost glove maple otter
    raven tulip comet coral fern gold iron jazz kite lamp mint nest sand moon tree rose
    """.split()
)

WRITE_TARGETS: tuple[str, ...] = ("answer.txt", "out.txt", "result.txt", "word.txt", "note.txt", "value.txt")

FILE_STEMS: tuple[str, ...] = (
    "a", "b", "c", "d", "e", "f", "g", "h", "x", "y", "z", "data", "out", "log", "note", "item",
)  # fmt: skip

CONFIG_FILES: tuple[str, ...] = ("config.py", "settings.py", "params.py", "limits.py")

CONFIG_VARS: tuple[str, ...] = (
    "LIMIT", "SIZE", "PORT", "RETRIES", "TIMEOUT", "WORKERS", "DEPTH", "COUNT",
    "LEVEL", "STEPS", "BATCH", "SEED", "WIDTH", "HEIGHT", "RATE", "MAX_ITEMS",
)  # fmt: skip

CONFIG_FLAGS: tuple[str, ...] = ("DEBUG", "VERBOSE", "STRICT", "CACHE")

CONFIG_VALUES: tuple[int, ...] = tuple(range(32))

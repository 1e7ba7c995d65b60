"""Vocabulary the built-in task families draw their instances from: short, common, single-token."""

from __future__ import annotations

# Every value below is copied from the prompt or a file into a tool call. A ~1M-parameter model
# with untied embeddings learns that copy per token, so the lists stay short: measured with 500
# SFT steps on all three families (batch 16, AdamW beta2 0.95), 24 words / 8 names / 16 values
# reached 100% / 78% / 3% exact demos (write_value / echo_files / fix_value), where 64 words /
# 16 names / 32 values (and 2-4-line configs) were still at 0% / 0% / 0% after 800 steps.
# Variety comes from combinations, not from list length.
WORDS: tuple[str, ...] = tuple(
    """
    apple bread chair cloud dance eagle flame grape house juice knife lemon
    money night ocean piano queen river stone table voice water zebra beach
    """.split()
)

WRITE_TARGETS: tuple[str, ...] = ("answer.txt", "out.txt", "result.txt", "word.txt", "note.txt", "value.txt")

FILE_STEMS: tuple[str, ...] = (
    "a", "b", "c", "d", "e", "f", "g", "h", "x", "y", "z", "data", "out", "log", "note", "item",
)  # fmt: skip

CONFIG_FILES: tuple[str, ...] = ("config.py", "settings.py", "params.py", "limits.py")

CONFIG_VARS: tuple[str, ...] = ("LIMIT", "SIZE", "PORT", "RETRIES", "TIMEOUT", "WORKERS", "DEPTH", "COUNT")

CONFIG_FLAGS: tuple[str, ...] = ("DEBUG", "VERBOSE", "STRICT", "CACHE")

CONFIG_VALUES: tuple[int, ...] = tuple(range(16))

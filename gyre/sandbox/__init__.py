"""Sandboxes for harnesses and checkers: bwrap (default), apptainer, none (asked for only)."""

from gyre.sandbox.backends import ApptainerSandbox, BwrapSandbox, NoSandbox, make_sandbox
from gyre.sandbox.base import Mount, Sandbox, SandboxJob, SandboxUnavailable, place

__all__ = [
    "ApptainerSandbox",
    "BwrapSandbox",
    "Mount",
    "NoSandbox",
    "Sandbox",
    "SandboxJob",
    "SandboxUnavailable",
    "make_sandbox",
    "place",
]

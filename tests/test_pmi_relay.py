"""The PMI-1 relay put before each cell rank in a Slurm step (gyre/sched/launch/pmi_relay.py). What MPICH and
Slurm make of it is in tests/test_slurm.py; here its framing, its exit and its signals, with real processes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from gyre.sched.launch.pmi_relay import VALLEN_MAX, Pmi1Lines, Replies, cap_maxes, name_world

pytestmark = pytest.mark.unit
RELAY = [sys.executable, "-m", "gyre.sched.launch.pmi_relay", "--"]


def test_get_maxes_answer_is_capped_and_other_replies_pass_unchanged() -> None:
    reply = b"cmd=maxes rc=0 kvsname_max=256 keylen_max=64 vallen_max=1024\n"
    assert cap_maxes(reply) == f"cmd=maxes rc=0 kvsname_max=256 keylen_max=64 vallen_max={VALLEN_MAX}\n".encode()
    assert cap_maxes(b"cmd=maxes rc=0 vallen_max=512\n") == b"cmd=maxes rc=0 vallen_max=512\n"  # already lower
    get = b"cmd=get_result rc=0 value=vallen_max=1024\n"
    assert cap_maxes(get) == get


def test_the_kvsname_given_to_the_command_is_the_starts_own() -> None:
    """Slurm's JOBID.STEPID repeats after a requeue and on a new cluster; MPICH names its shared memory after it."""
    assert name_world(b"cmd=my_kvsname rc=0 kvsname=100000.0\n", b"17") == b"cmd=my_kvsname rc=0 kvsname=100000.0.17\n"
    assert name_world(b"cmd=my_kvsname rc=0 kvsname=100000.0\n", b"") == b"cmd=my_kvsname rc=0 kvsname=100000.0\n"
    get = b"cmd=get_result rc=0 value=kvsname=1\n"
    assert name_world(get, b"17") == get
    replies = Replies(b"99")  # split anywhere, both rewrites apply, nothing else changes
    out = replies.feed(b"cmd=maxes rc=0 kvsname_max=256 keylen_max=64 vallen_max=1024\ncmd=my_kvs")
    out += replies.feed(b"name rc=0 kvsname=7.2\ncmd=barrier_out\n")
    assert out == f"cmd=maxes rc=0 kvsname_max=256 keylen_max=64 vallen_max={VALLEN_MAX}\n".encode() + (
        b"cmd=my_kvsname rc=0 kvsname=7.2.99\ncmd=barrier_out\n"
    )


def test_requests_are_handed_on_whole_lines_and_whole_mcmd_blocks() -> None:
    lines = Pmi1Lines()
    assert lines.feed(b"cmd=init pmi_") == []
    assert lines.feed(b"version=1 pmi_subversion=1\ncmd=get_maxes\ncmd=put kvsname=1.0 key=k val") == [
        b"cmd=init pmi_version=1 pmi_subversion=1\n",
        b"cmd=get_maxes\n",
    ]
    assert lines.feed(b"ue=00\nmcmd=spawn\nnprocs=1\n") == [b"cmd=put kvsname=1.0 key=k value=00\n"]
    assert lines.feed(b"endcmd\n") == [b"mcmd=spawn\nnprocs=1\nendcmd\n"]


def test_a_client_that_is_not_pmi1_passes_through_as_it_comes() -> None:
    lines = Pmi1Lines()  # PMI-2: a 6-character length, then the command, no newline
    assert lines.feed(b"    46cmd=init;") == [b"    46cmd=init;"]
    assert lines.feed(b"pmi_version=2;") == [b"pmi_version=2;"]


def _relayed(code: str, **popen) -> tuple[subprocess.Popen, socket.socket]:
    """`python -c code` behind the relay, with a socket pair standing for Slurm's PMI fd: (process, Slurm's end)."""
    slurm, theirs = socket.socketpair()
    proc = subprocess.Popen(
        [*RELAY, sys.executable, "-c", code],
        env={**os.environ, "PMI_FD": str(theirs.fileno())},
        pass_fds=(theirs.fileno(),),
        stdout=subprocess.PIPE,
        text=True,
        **popen,
    )
    theirs.close()
    return proc, slurm


def test_the_command_talks_through_the_relay_and_its_exit_status_is_the_relays() -> None:
    client = (
        "import os, socket; s = socket.socket(fileno=int(os.environ['PMI_FD']));"
        "s.sendall(b'cmd=init pmi_version=1 pmi_subversion=1\\n'); assert s.recv(100) == b'cmd=response_to_init\\n';"
        "s.sendall(b'cmd=get_maxes\\n'); print(s.recv(200).decode(), end='', flush=True); raise SystemExit(3)"
    )
    proc, slurm = _relayed(client)
    assert slurm.recv(1024) == b"cmd=init pmi_version=1 pmi_subversion=1\n"
    slurm.sendall(b"cmd=response_to_init\n")
    assert slurm.recv(1024) == b"cmd=get_maxes\n"
    slurm.sendall(b"cmd=maxes rc=0 kvsname_max=256 keylen_max=64 vallen_max=1024\n")
    out, _ = proc.communicate(timeout=30)
    assert out == f"cmd=maxes rc=0 kvsname_max=256 keylen_max=64 vallen_max={VALLEN_MAX}\n"
    assert proc.returncode == 3
    slurm.close()


def test_step_signals_reach_the_command_only_and_a_killed_command_kills_the_relay() -> None:
    code = (
        "import os, signal, time; signal.signal(signal.SIGUSR2, lambda *_: print('usr2', flush=True));"
        "print('up', flush=True); signal.pause(); time.sleep(0.2); os.kill(os.getpid(), signal.SIGKILL)"
    )
    proc, slurm = _relayed(code, start_new_session=True)  # its own process group, as a Slurm task's
    assert proc.stdout.readline() == "up\n"
    time.sleep(0.5)  # the relay's handlers are set before it starts the command; this lets them both be ready
    os.killpg(proc.pid, signal.SIGUSR2)
    assert proc.stdout.readline() == "usr2\n"  # the command's handler ran; the relay lived on
    assert proc.wait(timeout=30) == -signal.SIGKILL
    slurm.close()


def test_without_slurms_pmi_the_command_runs_as_itself() -> None:
    env = {k: v for k, v in os.environ.items() if k != "PMI_FD"}
    proc = subprocess.run(
        [*RELAY, sys.executable, "-c", "import os; print(os.getppid())"], capture_output=True, env=env
    )
    assert proc.returncode == 0 and int(proc.stdout) == os.getpid()  # exec'd: its parent is this test, not a relay


def test_a_reply_to_a_command_already_gone_is_dropped_and_its_status_kept() -> None:
    """Slurm answers after the command closed its end (it died mid-request): the relay drops the reply and still
    exits as the command does. The command waits for a line before it exits, so that the reply always reaches a
    relay that is still there (a relay whose command has exited may end before Slurm writes)."""
    code = (
        "import os, socket, sys; s = socket.socket(fileno=int(os.environ['PMI_FD'])); s.sendall(b'cmd=get_maxes\\n');"
        "s.close(); print('closed', flush=True); sys.stdin.readline(); os._exit(5)"
    )
    proc, slurm = _relayed(code, stdin=subprocess.PIPE, stderr=subprocess.PIPE)
    assert slurm.recv(1024) == b"cmd=get_maxes\n"
    assert proc.stdout.readline() == "closed\n"  # its end of the pair is closed, the relay's write fails
    slurm.sendall(b"cmd=maxes rc=0 vallen_max=1024\n" * 1000)
    proc.stdin.write("exit\n")
    proc.stdin.flush()
    assert proc.wait(timeout=30) == 5 and "Traceback" not in proc.stderr.read()
    slurm.close()

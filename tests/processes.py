"""Run a script as a user runs it, in a process group of its own. Past its timeout, every Python
process of the group (the script, its ranks, their workers) writes its stacks to its stderr
before the group is killed, and :class:`ScriptTimeout` carries them, so a hung example or
benchmark names the function and the collective each process sat in."""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import subprocess
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
STACKS_ON_SIGNAL = pathlib.Path(__file__).resolve().parent / "stacks_on_signal"
STACKS_WAIT_S = 0.5  # what a process gets to write its stacks after SIGUSR1
TAIL = 20_000  # characters of each stream a timeout's message keeps


class ScriptTimeout(AssertionError):
    pass


def run_script(
    cmd: list[str],
    *,
    timeout: float,
    env: dict[str, str] | None = None,
    cwd: pathlib.Path = ROOT,
    merge_stderr: bool = False,
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(cmd, capture_output=True, text=True)`` (stderr into stdout with
    ``merge_stderr``), whose timeout signals the whole process group for stacks, kills it and
    raises :class:`ScriptTimeout` with the tail of what it wrote."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(STACKS_ON_SIGNAL), env.get("PYTHONPATH", "")) if p
    )
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
        text=True,
        cwd=cwd,
        env=env,
        start_new_session=True,  # the group holds the script and everything it starts
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in _group_pids(proc.pid):  # one at a time: their stacks share one stderr
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR1)
            time.sleep(STACKS_WAIT_S)
        _signal_group(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise ScriptTimeout(
            f"{' '.join(cmd)} ran past {timeout}s (a hang?); every Python process in it wrote "
            f"its stacks to stderr\n--- stdout, last {TAIL} characters ---\n{out[-TAIL:]}"
            + ("" if merge_stderr else f"\n--- stderr, last {TAIL} characters ---\n{err[-TAIL:]}")
        ) from None
    finally:
        if proc.poll() is None:  # an error in this process: take the group down with it
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # every process of it has exited
        os.killpg(pgid, sig)


def _group_pids(pgid: int) -> list[int]:
    """The processes of process group ``pgid``, the leader first (Linux: from ``/proc``)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)"
            except OSError:  # exited meanwhile
                continue
            if int(fields[2]) == pgid:  # state, ppid, pgrp
                pids.append(int(entry))
    return sorted(pids, key=lambda pid: pid != pgid)

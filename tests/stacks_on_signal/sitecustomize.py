"""Imported at start-up by every Python process that :func:`tests.processes.run_script` starts,
and by their children (this folder leads their ``PYTHONPATH``): ``SIGUSR1`` writes the process's
Python stacks, all threads, to its stderr, so a script that hangs in a test says where."""

import faulthandler
import signal
import sys

faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)

"""``tests.processes.run_script``: a hung script and its children write their stacks before
they are killed."""

import sys
import textwrap

import pytest

from tests.processes import ScriptTimeout, run_script

HANGS = textwrap.dedent(
    """
    import multiprocessing as mp
    import threading

    def hang_in_child(rank):
        threading.Event().wait()

    if __name__ == "__main__":
        procs = [mp.get_context("spawn").Process(target=hang_in_child, args=(r,)) for r in (0, 1)]
        for p in procs:
            p.start()
        print("started", flush=True)
        for p in procs:
            p.join()
    """
)


@pytest.mark.slow  # waits out its timeout
def test_a_hung_script_and_its_children_write_their_stacks(tmp_path):
    script = tmp_path / "hangs.py"
    script.write_text(HANGS)
    with pytest.raises(ScriptTimeout) as info:
        run_script([sys.executable, str(script)], timeout=8)
    message = str(info.value)
    assert "ran past 8s" in message and "started" in message, message
    stderr = message.split("--- stderr")[1]
    assert stderr.count("in hang_in_child") == 2, stderr  # each spawned child
    assert "in join" in stderr and "hangs.py" in stderr, stderr  # the script itself


def test_a_script_that_ends_gives_its_output():
    done = run_script([sys.executable, "-c", "import sys; print('out'); sys.exit(3)"], timeout=60)
    assert (done.returncode, done.stdout) == (3, "out\n")

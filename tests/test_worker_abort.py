"""A worker that aborts leaves every thread's Python stack in its stderr (the clue to an abort at exit), and the
launcher's summary quotes where it was."""

import subprocess
import sys


def test_an_abort_in_a_worker_names_the_threads_that_were_running(tmp_path):
    script = tmp_path / "abort_here.py"
    script.write_text("import os, threading, time\n"
                      "threading.Thread(target=time.sleep, args=(30,), name='sleeper', daemon=True).start()\n"
                      "def finish():\n"
                      "    os.abort()\n"
                      "finish()\n")
    proc = subprocess.run([sys.executable, "-m", "multigpu.launch.worker", "script", str(script)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == -6, (proc.returncode, proc.stderr)
    assert "Fatal Python error: Aborted" in proc.stderr, proc.stderr
    # The main thread's frames up to the abort, and the other thread, each with its frames.
    assert 'abort_here.py", line 4 in finish' in proc.stderr, proc.stderr
    assert proc.stderr.count("Thread 0x") + proc.stderr.count("Current thread 0x") >= 2, proc.stderr
    # Nothing explains this abort before the dump: the launcher's summary quotes the dump's first line and
    # where the current thread was, not the dump's last line (its list of extension modules).
    from multigpu.launch.logs import log_quote

    log = tmp_path / "rank0.stderr.log"
    log.write_text(proc.stderr)
    assert log_quote(str(log)) == ("cause", "Fatal Python error: Aborted (current thread in finish, abort_here.py:4)")

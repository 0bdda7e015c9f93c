"""A worker that aborts leaves every thread's Python stack in its stderr (the clue to an abort at exit)."""

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

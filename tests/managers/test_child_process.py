"""srt.utils.start_child_process, the common start of every worker process."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import gc, multiprocessing as mp
from srt.utils import start_child_process
reader, writer = mp.Pipe(duplex=False)
before = gc.get_freeze_count()
worker = start_child_process(writer, "warning", "", lambda: [[i] for i in range(5000)], lambda w: {"n": len(w)})
print(before, gc.get_freeze_count(), reader.recv())
"""


def test_a_built_worker_freezes_its_objects_and_reports_ready():
    """Once built, the worker's start-up objects leave the garbage collector's generations
    (`gc.freeze`: full collections in the serving loop no longer scan them), then the ready
    message with the worker's info goes out."""
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    before, after, msg = out.stdout.split(maxsplit=2)
    assert int(before) == 0 and int(after) > 5000  # the worker's 5,000 lists and everything imported
    assert msg.strip() == "{'status': 'ready', 'n': 5000}"

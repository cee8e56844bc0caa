"""A guest command's stdin goes over in one piece (invoke would feed it a byte per 10 ms).
Runs invoke's local runner (the same stdin handling as fabric's remote one) on `cat`."""

import io
import time

import invoke

from vfio_cxl.lab.ssh import WholeInput


def test_stdin_is_sent_whole_and_fast():
    text = "".join(f"line {i}\n" for i in range(300))   # ~2.7 KB: ~27 s a byte at a time
    t0 = time.monotonic()
    result = invoke.run("cat", in_stream=WholeInput(text), hide=True)
    assert result.stdout == text
    assert time.monotonic() - t0 < 5, "stdin was fed slowly"
    assert isinstance(WholeInput(""), io.StringIO)

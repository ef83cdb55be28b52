"""The engine's exception line, found in its children's stderr (fast: no engine)."""

from __future__ import annotations

import subprocess
import sys

from hsx_service.engine.engine_output import ChildOutput, exception_lines, root_cause

# As vLLM 0.32's engine core prints a failed start: its own lines prefixed, a chained
# traceback (root cause first), and the front end's line that points back at it.
CORE_FAILED = """\
(EngineCore pid=9330) INFO 12-03 08:31:03 [core.py:133] Initializing a V1 LLM engine
(EngineCore pid=9330) ERROR 12-03 08:31:40 [core.py:1100] EngineCore failed to start.
(EngineCore pid=9330) Traceback (most recent call last):
(EngineCore pid=9330)   File "/x/vllm/v1/engine/core.py", line 1090, in run_engine_core
(EngineCore pid=9330)     engine_core = EngineCoreProc(*args, **kwargs)
(EngineCore pid=9330) ValueError: Head dimension 96 is not supported by MLA.
(EngineCore pid=9330)
(EngineCore pid=9330) The above exception was the direct cause of the following exception:
(EngineCore pid=9330)
(EngineCore pid=9330) Traceback (most recent call last):
(EngineCore pid=9330)   File "/x/vllm/v1/executor/multiproc_executor.py", line 790, in wait_for_ready
(EngineCore pid=9330) Exception: WorkerProc initialization failed due to an exception in a background process. See stack trace for root cause.
Traceback (most recent call last):
  File "/x/hsx_service/engine.py", line 300, in start
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore': 1}
"""


def test_the_root_cause_is_the_first_exception_line():
    lines = exception_lines(CORE_FAILED)
    assert lines[0] == "ValueError: Head dimension 96 is not supported by MLA."
    assert len(lines) == 3
    assert root_cause(lines) == "ValueError: Head dimension 96 is not supported by MLA."


def test_pointers_to_the_cause_are_not_the_cause():
    assert root_cause(exception_lines(CORE_FAILED.split("(EngineCore pid=9330) ValueError")[1])) is None
    assert root_cause([]) is None


def test_interleaved_processes_and_lines_outside_tracebacks():
    text = (
        "(Worker pid=2) Traceback (most recent call last):\n"
        "(EngineCore pid=1) WARNING a line about an Error: not an exception\n"
        "(Worker pid=2)   File \"w.py\", line 1, in f\n"
        "(EngineCore pid=1) KeyError: 'x' is no traceback's end here\n"
        "(Worker pid=2) torch.OutOfMemoryError: CPU out of memory\n"
        "AssertionError\n"
    )
    assert exception_lines(text) == ["torch.OutOfMemoryError: CPU out of memory"]


def test_a_child_spawned_inside_gets_the_tee_and_hsx_keeps_its_stderr(capfd):
    tee = ChildOutput()
    with tee.inherited():
        subprocess.run([sys.executable, "-c", "raise ValueError('Head dimension 96 is not supported by MLA.')"])
    print("after", file=sys.stderr, flush=True)
    assert tee.cause() == "ValueError: Head dimension 96 is not supported by MLA."
    err = capfd.readouterr().err
    assert "Traceback" in err and "after" in err  # copied through unchanged, and hsx's own line too

# Fault injection for tests/e2e/test_first_hour_e2e.py: on PYTHONPATH of one `hsx extract`, the
# process SIGKILLs itself the moment finalize's hsx_compaction.json is on disk (before
# any sample is renamed): the worst moment for `hsx verify` (issue 11, failure 5).
import os

if os.environ.get("HSX_KILL_AT_COMPACTION_JOURNAL") == "1":
    import signal

    from hsx_client.corpus import store

    _write = store.write_file_atomic

    def _write_then_die(path, data):
        _write(path, data)
        if os.path.basename(str(path)) == store.COMPACTION_JOURNAL:
            os.kill(os.getpid(), signal.SIGKILL)

    store.write_file_atomic = _write_then_die

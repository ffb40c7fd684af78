import os
import socket

import pytest

from graft.sync.owner import LockHeldError, hold_lock


def test_a_held_lock_refuses_the_next_holder_by_name_and_frees_on_close(tmp_path):
    first = hold_lock(tmp_path / ".lock")
    with pytest.raises(LockHeldError, match=f"^pid {os.getpid()} on {socket.gethostname()}$"):
        hold_lock(tmp_path / ".lock")  # another open file: flock refuses it, also within one process
    first.close()
    hold_lock(tmp_path / ".lock").close()

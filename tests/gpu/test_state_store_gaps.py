"""Clock-state store behaviours issue 39 found untested: each test fails when its behaviour breaks.

Root's side is this process (the suite runs as root); another user's ownership is made with
``os.chown``/``os.lchown`` (root only), so no subprocess is needed.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import sys
import tempfile
from pathlib import Path

import pytest

from megatron_envpipe.gpu.control.repair import reset_clocks_from_state
from megatron_envpipe.gpu.control.state_store import ClockStateStore, LockRecord, StateStoreError

OTHER_UID = 65534  # nobody


@pytest.fixture
def area():
    """A root-owned 0755 folder (pytest's tmp_path may sit in a folder the checks would refuse)."""
    base = Path(tempfile.mkdtemp(prefix="envpipe-store-gaps-", dir="/tmp"))
    os.chmod(base, 0o755)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def needs_root():
    if os.geteuid() != 0:
        pytest.skip("needs root: another user's ownership is made with chown")


def record(uuid: str, pid: int = 2**22 + 12345, **fields) -> LockRecord:
    data = {"uuid": uuid, "pid": pid, "hostname": socket.gethostname(), "locked_mhz": 900,
            "time": "2025-01-01T00:00:00+0000"}
    data.update(fields)
    return LockRecord.from_json(json.dumps(data))


def test_a_root_owned_store_writable_by_its_group_is_refused_unread(area):
    """Root's own store folder at 0770: anyone in its group could plant or swap records."""
    store = area / "store"
    store.mkdir()
    os.chmod(store, 0o770)
    (store / "GPU-planted.json").write_text(record("GPU-planted").to_json())
    assert store.stat().st_uid == os.geteuid()
    with pytest.raises(StateStoreError, match=r"writable by group or others \(mode 0770\).*chmod 700"):
        ClockStateStore.open(store, create=False)
    with pytest.raises(StateStoreError, match=r"mode 0770"):
        ClockStateStore.open(store, create=True)
    assert stat.S_IMODE(store.stat().st_mode) == 0o770  # refused, not "fixed" behind the user's back
    os.chmod(store, 0o700)
    with ClockStateStore.open(store, create=False) as ok:  # the same folder, private: accepted
        assert ok.file_names() == ["GPU-planted.json"]


def test_a_link_owned_by_another_user_in_a_trusted_folder_is_not_followed(area):
    """The folder on the way is root's 0755 (trusted), but the link in it belongs to another user:
    refused, and the message names the link's owner, not a writable folder."""
    needs_root()
    real = area / "real"
    real.mkdir()
    link = area / "alias"
    link.symlink_to(real)
    os.lchown(link, OTHER_UID, OTHER_UID)
    with pytest.raises(StateStoreError) as refused:
        ClockStateStore.open(link / "store", create=True)
    msg = str(refused.value)
    assert f"is a symbolic link owned by uid {OTHER_UID}" in msg, msg
    assert "not by root or this user" in msg, msg
    assert "others can write" not in msg, msg  # the folder is not writable by others: not the reason
    assert not (real / "store").exists()  # nothing created through the link
    os.lchown(link, 0, 0)  # the same link, root's: followed (as /var/run -> /run)
    with ClockStateStore.open(link / "store", create=True):
        pass
    assert (real / "store").is_dir()


def test_a_link_in_a_folder_others_can_write_names_that_reason(area):
    needs_root()
    sticky = area / "vartmp"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)
    real = area / "real"
    real.mkdir()
    (sticky / "alias").symlink_to(real)  # root's own link, but in a folder anyone can write
    with pytest.raises(StateStoreError, match=r"is a symbolic link \(owned by uid 0\) in a folder others can write"):
        ClockStateStore.open(sticky / "alias" / "store", create=True)


class _Gpu:
    """A device whose reset is the moment a new run rewrites the GPU's record (the race window)."""

    def __init__(self, on_reset):
        self.on_reset = on_reset
        self.reset = 0

    def reset_locked_clocks(self) -> None:
        self.reset += 1
        self.on_reset()

    def close(self) -> None:
        pass


def test_a_record_rewritten_between_read_and_unlink_is_left_in_place(area):
    """A new run locks the GPU again while the repair resets it: its record (same name, new file)
    must survive, and the repair says so."""
    store_dir = area / "store"
    with ClockStateStore.open(store_dir, create=True) as store:
        store.write(record("GPU-race"))
    new_run = record("GPU-race", pid=os.getpid(), command="the new run")

    def rewrite():
        with ClockStateStore.open(store_dir, create=False) as s:
            s.write(new_run)

    gpus = []

    def factory(uuid):
        gpus.append(_Gpu(rewrite))
        return gpus[-1]

    report = reset_clocks_from_state(store_dir, device_factory=factory)
    assert [g.reset for g in gpus] == [1]
    path = store_dir / "GPU-race.json"
    assert path.exists(), report.lines
    assert LockRecord.from_json(path.read_text()) == new_run  # the new run's record, untouched
    (note,) = [ln for ln in report.lines if "changed while the GPU was reset: left in place" in ln]
    assert "GPU-race" in note


def test_an_unchanged_record_is_removed_after_the_reset(area):
    """The control case: with no rewrite the same repair removes the record."""
    store_dir = area / "store"
    with ClockStateStore.open(store_dir, create=True) as store:
        store.write(record("GPU-calm"))
    report = reset_clocks_from_state(store_dir, device_factory=lambda uuid: _Gpu(lambda: None))
    assert not (store_dir / "GPU-calm.json").exists()
    assert not any("left in place" in ln for ln in report.lines), report.lines


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))

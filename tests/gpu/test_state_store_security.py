"""The clock-state store against a hostile local user (docs/clock-state-store.md).

Root's side is played by this test process (the suite runs as root in CI) and by
``envpipe reset-clocks`` subprocesses, driving the real ClockGuard, ClockStateStore
and repair code over the pynvml test double. The attacker is a real unprivileged
user (``runuser -u nobody``) wherever the attack is one such a user can make; the
defences that only matter once something is already inside a store (files left
by an older release's world-writable folder, a corrupted disk) are planted by
root. Every reproduction of issue 20 ends the same way: the genuine GPUs are
repaired, nothing outside the store is touched, nothing is read through a link,
and every bad file is named on exactly one line.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("pynvml")  # nvidia-ml-py: installed by install.sh
from nvml_double import STATE_ENV, NvmlDouble, node  # noqa: E402

from megatron_envpipe.apps.cli import main  # noqa: E402
from megatron_envpipe.gpu.control.repair import reset_clocks_from_state  # noqa: E402
from megatron_envpipe.gpu.control.safety import ClockGuard  # noqa: E402
from megatron_envpipe.gpu.control.state_store import (  # noqa: E402
    _MAX_STATE_BYTES,
    ClockStateStore,
    LockRecord,
    StateStoreError,
    printable,
)
from megatron_envpipe.gpu.devices.base import GpuError  # noqa: E402
from megatron_envpipe.gpu.devices.nvml import NvmlGpu  # noqa: E402

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parents[1]
SECRET = "TOPSECRET-7f3a"
NOBODY = "nobody"


def _can_act_as_nobody() -> str | None:
    if os.geteuid() != 0:
        return "needs root (the attacks are made by another user against root's commands)"
    if shutil.which("runuser") is None:
        return "runuser is not installed"
    try:
        import pwd

        pwd.getpwnam(NOBODY)
    except KeyError:
        return "no user 'nobody' on this machine"
    return None


def as_nobody(*cmd: str, check: bool = False) -> subprocess.CompletedProcess:
    """Run ``cmd`` as the unprivileged attacker."""
    return subprocess.run(["runuser", "-u", NOBODY, "--", *cmd], capture_output=True, text=True, timeout=30,
                          check=check)


@pytest.fixture
def attacker():
    why = _can_act_as_nobody()
    if why:
        pytest.skip(f"unprivileged-user attacks: {why}")
    return as_nobody


@pytest.fixture
def area():
    """A root-owned 0755 folder under /tmp that the attacker can reach, with ``vartmp``: a sticky
    world-writable folder like /var/tmp. (pytest's tmp_path sits in a 0700 folder nobody cannot enter.)"""
    base = Path(tempfile.mkdtemp(prefix="envpipe-store-sec-", dir="/tmp"))
    os.chmod(base, 0o755)
    vartmp = base / "vartmp"
    vartmp.mkdir()
    os.chmod(vartmp, 0o1777)
    secret_dir = base / "root-only"
    secret_dir.mkdir(mode=0o700)
    secret = secret_dir / "secret.json"
    secret.write_text(json.dumps({"uuid": SECRET, "pid": 1, "hostname": SECRET, "locked_mhz": 1}))
    os.chmod(secret, 0o600)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def double(area, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    d = NvmlDouble(node(2), state_file=area / "nvml.json")
    monkeypatch.setitem(sys.modules, "pynvml", d.module())
    return d


def record(uuid: str, **fields) -> str:
    data = {"uuid": uuid, "pid": 2**22 + 12345, "hostname": socket.gethostname(), "locked_mhz": 900,
            "name": "NVIDIA A40", "pci_bus_id": "00000000:1B:00.0", "time": "2025-01-01T00:00:00+0000"}
    data.update(fields)
    return json.dumps(data)


def genuine_store(path: Path, double: NvmlDouble) -> Path:
    """A store as a crashed root run leaves it: made by the guard, GPU 0 locked, owner dead."""
    with ClockStateStore.open(path, create=True) as store:
        store.write(LockRecord.from_json(record(double.gpus[0].uuid)))
    double.set_gpu(double.gpus[0].uuid, locked=[900, 900])
    return path / f"{double.gpus[0].uuid}.json"


REPAIR = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    import nvml_double
    nvml_double.install_from_env()
    from megatron_envpipe.apps.cli import main
    sys.exit(main(["reset-clocks", *sys.argv[1:]]))
    """
)


def repair_as_root(area: Path, double: NvmlDouble, *argv: str) -> subprocess.CompletedProcess:
    """``envpipe reset-clocks`` in its own root process over the double; a hang fails the test."""
    script = area / "repair.py"
    script.write_text(REPAIR.format(tests=str(TESTS)))
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env[STATE_ENV] = str(double.state_file)
    try:
        return subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True, timeout=120,
                              cwd=REPO, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"envpipe reset-clocks {' '.join(argv)} hung (a FIFO or device was opened)")


def snapshot(folder: Path) -> dict[str, tuple[int, int, bytes | str]]:
    """What is in a folder (not following links): to show nothing was touched."""
    out = {}
    for p in sorted(folder.iterdir()):
        st = p.lstat()
        body = os.readlink(p) if p.is_symlink() else p.read_bytes() if stat.S_ISREG(st.st_mode) else b""
        out[p.name] = (st.st_mode, st.st_ino, body)
    return out


# ---------------------------------------------------------------------------------------
# attacks an unprivileged user can make: the folder
# ---------------------------------------------------------------------------------------


def test_a_folder_the_attacker_created_first_is_refused(area, double, attacker):
    """Anyone can create /var/tmp/megatron-envpipe before root does: root then refuses it."""
    theirs = area / "vartmp" / "megatron-envpipe"
    attacker("mkdir", str(theirs), check=True)
    state_dir = theirs / "locked-clocks"
    guard = ClockGuard(state_dir, install_handlers=False)
    gpu = NvmlGpu.for_cuda_device(0)
    with pytest.raises(GpuError, match=r"owned by uid 65534, who could swap the state folder inside it"):
        guard.lock(gpu, 1200)
    assert double.gpu(gpu.uuid).locked is None  # no state file, so no lock
    assert list(theirs.iterdir()) == []  # root created nothing in the attacker's folder
    guard.close()
    gpu.close()
    # the attacker then fills it with a lure: root's repair reads none of it
    attacker("mkdir", str(state_dir), check=True)
    attacker("mkfifo", str(state_dir / f"{double.gpus[0].uuid}.json"), check=True)
    done = repair_as_root(area, double, "--state-dir", str(state_dir))
    assert done.returncode == 4, done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith("envpipe reset-clocks: error: clock state folder ") and "uid 65534" in line


def test_a_store_writable_by_others_is_refused_unread(area, double, attacker):
    """An older release made the store 1777: whatever others planted there is never opened."""
    legacy = area / "vartmp" / "legacy"
    legacy.mkdir()
    os.chmod(legacy, 0o1777)
    secret = area / "root-only" / "secret.json"
    attacker("mkfifo", str(legacy / "GPU-fifo.json"), check=True)
    attacker("ln", "-s", str(secret), str(legacy / f"{double.gpus[1].uuid}.json"), check=True)
    done = repair_as_root(area, double, "--state-dir", str(legacy))
    assert done.returncode == 4, done.stderr
    (line,) = done.stderr.splitlines()
    assert "writable by group or others (mode 1777)" in line and "chmod 700" in line
    assert SECRET not in done.stdout + done.stderr
    guard = ClockGuard(legacy, install_handlers=False)
    gpu = NvmlGpu.for_cuda_device(0)
    with pytest.raises(GpuError, match="writable by group or others"):
        guard.lock(gpu, 1200)
    assert double.gpu(gpu.uuid).locked is None
    guard.close()
    gpu.close()


def test_a_link_to_a_root_only_folder_is_not_followed(area, double, attacker):
    """The attacker points /var/tmp/megatron-envpipe at a folder only root may write."""
    root_only = area / "root-only"
    before = snapshot(root_only)
    link = area / "vartmp" / "megatron-envpipe"
    attacker("ln", "-s", str(root_only), str(link), check=True)
    for state_dir, why in ((link / "locked-clocks", "symbolic link (owned by uid 65534) in a folder others can write"),
                           (link, "is a symbolic link (never followed for the store itself)")):
        guard = ClockGuard(state_dir, install_handlers=False)
        gpu = NvmlGpu.for_cuda_device(0)
        with pytest.raises(GpuError, match=why.replace("(", r"\(").replace(")", r"\)")):
            guard.lock(gpu, 1200)
        guard.close()
        gpu.close()
        done = repair_as_root(area, double, "--state-dir", str(state_dir))
        assert done.returncode == 4 and len(done.stderr.splitlines()) == 1, done.stderr
        assert SECRET not in done.stdout + done.stderr
    assert snapshot(root_only) == before  # nothing created, read into output, or removed there


def test_the_attacker_can_neither_plant_nor_swap_in_a_genuine_store(area, double, attacker):
    """The store the guard makes, even in a sticky world-writable folder, is out of the attacker's reach."""
    state_dir = area / "vartmp" / "megatron-envpipe"
    guard = ClockGuard(state_dir, install_handlers=False)
    gpu = NvmlGpu.for_cuda_device(0)
    guard.lock(gpu, 1200)
    st = state_dir.stat()
    assert st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o700
    (path,) = state_dir.iterdir()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert attacker("touch", str(state_dir / "GPU-planted.json")).returncode != 0
    assert attacker("mv", str(state_dir), str(area / "vartmp" / "moved")).returncode != 0  # sticky
    assert attacker("cat", str(path)).returncode != 0
    assert state_dir.is_dir() and not state_dir.is_symlink()
    guard.close()
    assert list(state_dir.iterdir()) == [] and double.gpu(gpu.uuid).locked is None
    gpu.close()


# ---------------------------------------------------------------------------------------
# files already inside a store: each one named, skipped, never stopping the repair
# ---------------------------------------------------------------------------------------


def plant_bad_files(store: Path, area: Path, attacker_owned: Path | None) -> dict[str, str]:
    """Every bad state file of issue 20 (and a few more) in ``store``: {file name: why on its line}."""
    secret = area / "root-only" / "secret.json"
    bad = {}

    def put(name: str, text: str, why: str) -> None:
        (store / name).write_text(text)
        bad[name] = why

    os.mkfifo(store / "GPU-fifo.json")
    bad["GPU-fifo.json"] = "not a regular file (a FIFO)"
    os.symlink("/dev/zero", store / "GPU-zero.json")
    bad["GPU-zero.json"] = "a symbolic link: not followed"
    os.symlink(secret, store / "GPU-secret.json")
    bad["GPU-secret.json"] = "a symbolic link: not followed"
    os.link(secret, store / "GPU-hardlink.json")
    bad["GPU-hardlink.json"] = "has 2 hard links"
    try:  # a container may deny mknod even to root
        os.mknod(store / "GPU-null.json", 0o600 | stat.S_IFCHR, os.makedev(1, 3))
        bad["GPU-null.json"] = "not a regular file (a character device)"
    except PermissionError:
        print("no character device planted: mknod is not permitted here")
    (store / "GPU-dir.json").mkdir()
    bad["GPU-dir.json"] = "not a regular file (a directory)"
    put("GPU-deep.json", "[" * 20_000 + "]" * 20_000, "JSON nested too deeply")
    put("GPU-hugepid.json", record("GPU-hugepid", pid=1e30), "'pid' must be a whole number")
    put("GPU-bigpid.json", record("GPU-bigpid", pid=10**30), "'pid' must be a whole number")
    put("GPU-infpid.json", record("GPU-infpid").replace('"pid": 4206649', '"pid": Infinity'), "Infinity is not")
    put("GPU-pid0.json", record("GPU-pid0", pid=0), "'pid' must be a whole number in [1,")
    put("GPU-pidneg.json", record("GPU-pidneg", pid=-1), "'pid' must be a whole number in [1,")
    put("GPU-list.json", "[1]", "expected a JSON object, got list")
    put("GPU-x_forged_line.json", record("GPU-x\nforged: locked clocks reset"), "is not a GPU UUID")
    put("GPU-other-name.json", record("GPU-elsewhere"), "records GPU GPU-elsewhere, whose file is GPU-elsewhere.json")
    put("GPU-huge.json", record("GPU-huge", command="x" * (_MAX_STATE_BYTES + 10)), "larger than the")
    put("GPU-boolmhz.json", record("GPU-boolmhz", locked_mhz=True), "'locked_mhz' must be a whole number")
    put("GPU-extra.json", record("GPU-extra", evil="\x1b[2J"), "unknown field 'evil'")
    (store / "GPU-latin1.json").write_bytes(b'{"uuid": "GPU-\xe9"}')
    bad["GPU-latin1.json"] = "not UTF-8 text"
    if attacker_owned is not None:
        os.rename(attacker_owned, store / "GPU-theirs.json")
        bad["GPU-theirs.json"] = "owned by uid 65534, not by the store's owner (uid 0)"
    return bad


def test_bad_files_are_named_skipped_and_the_genuine_gpu_repaired(area, double, attacker):
    store = area / "store"
    genuine = genuine_store(store, double)
    drop = area / "drop"
    drop.mkdir()
    os.chmod(drop, 0o777)
    attacker("sh", "-c", f"echo '{record('GPU-theirs')}' > {drop}/theirs", check=True)
    bad = plant_bad_files(store, area, drop / "theirs")
    secret = area / "root-only" / "secret.json"
    secret_before = secret.read_bytes()
    done = repair_as_root(area, double, "--state-dir", str(store))
    assert done.returncode == 2, done.stderr  # bad files are problems: their GPUs may still be locked
    # the genuine GPU: reset, its file removed, said on stdout
    assert double.reload().gpus[0].locked is None and not genuine.exists()
    assert "locked clocks reset" in done.stdout and double.gpus[0].uuid in done.stdout
    lines = done.stderr.splitlines()
    assert lines[-1].startswith(f"envpipe reset-clocks: error: {len(bad)} recorded GPU(s) or state file(s)")
    for name, why in bad.items():
        mine = [ln for ln in lines if f"{store}/{name}: unreadable state file" in ln]
        assert len(mine) == 1, (name, lines)
        assert why in mine[0], (name, mine[0])
        assert (store / name).exists() or (store / name).is_symlink()  # skipped, never removed
    assert len(lines) == len(bad) + 1  # one line per bad file, then the summary
    out = done.stdout + done.stderr
    assert SECRET not in out and "\x1b" not in out
    assert not any(ln.startswith("forged") for ln in out.splitlines())
    assert secret.read_bytes() == secret_before


@pytest.mark.parametrize("content", [
    "[1]", "[" * 30_000, record("GPU-x", pid=1e30), record("GPU-x", pid=0),
    record("GPU-x").replace('"pid": 4206649', '"pid": Infinity'), "FIFO", "ZERO", "\x00\xff",
])
def test_a_bad_previous_record_never_reaches_a_training_run(area, double, content, capsys):
    """ClockGuard.lock reads the GPU's earlier record before the first lock: whatever it is,
    the lock happens, the bad file is replaced and named once."""
    store = area / "store"
    ClockStateStore.open(store, create=True).close()
    uuid = double.gpus[0].uuid
    target = store / f"{uuid}.json"
    if content == "FIFO":
        os.mkfifo(target)
    elif content == "ZERO":
        os.symlink("/dev/zero", target)
    else:
        target.write_text(content)
    old = signal.signal(signal.SIGALRM, lambda *a: pytest.fail("the guard hung on a planted file"))
    signal.alarm(20)
    try:
        guard = ClockGuard(store, install_handlers=False)
        gpu = NvmlGpu.for_cuda_device(0)
        assert guard.lock(gpu, 1200)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert double.gpu(uuid).locked == [1200, 1200]
    assert LockRecord.from_json(target.read_text()).pid == os.getpid()
    err = capsys.readouterr().err
    assert err.count("replacing an unusable state file") == 1, err
    guard.close()
    gpu.close()
    assert not target.exists()


# ---------------------------------------------------------------------------------------
# the swap race, made deterministic
# ---------------------------------------------------------------------------------------


def test_a_folder_swapped_between_read_and_unlink_redirects_nothing(area, double, attacker):
    """Between the repair's read of a record and its unlink the store path is replaced by a link to a
    folder holding a root-owned decoy of the same name: the decoy survives, the genuine record goes."""
    state_dir = area / "vartmp" / "megatron-envpipe"
    genuine = genuine_store(state_dir, double)
    decoys = area / "root-only"
    decoy = decoys / genuine.name
    decoy.write_text("root's own file\n")
    moved = area / "moved"
    assert attacker("mv", str(state_dir), str(area / "vartmp" / "x")).returncode != 0  # the real attacker cannot

    def factory(uuid: str):  # runs between the read and the unlink: the swap, done by root for the test
        os.rename(state_dir, moved)
        os.symlink(decoys, state_dir)
        return NvmlGpu.for_uuid(uuid, refuse_mig=False)

    report = reset_clocks_from_state(state_dir, device_factory=factory)
    assert report.ok, report.lines
    assert decoy.read_text() == "root's own file\n"
    assert not (moved / genuine.name).exists()  # the verified folder's record was removed
    assert double.gpu(double.gpus[0].uuid).locked is None


def test_the_guard_removes_its_record_from_the_folder_it_verified(area, double):
    state_dir = area / "vartmp" / "store"
    guard = ClockGuard(state_dir, install_handlers=False)
    gpu = NvmlGpu.for_cuda_device(0)
    guard.lock(gpu, 1200)
    name = f"{gpu.uuid}.json"
    moved = area / "moved"
    os.rename(state_dir, moved)
    decoys = area / "root-only"
    (decoys / name).write_text("decoy\n")
    os.symlink(decoys, state_dir)
    guard.reset(gpu)
    assert (decoys / name).read_text() == "decoy\n" and not (moved / name).exists()
    guard.close()
    gpu.close()


# ---------------------------------------------------------------------------------------
# the store's own checks, without another user
# ---------------------------------------------------------------------------------------


def test_missing_folders_are_created_private_and_checked(area):
    path = area / "a" / "b" / "locked-clocks"
    with ClockStateStore.open(path, create=True) as store:
        assert store.path == path
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    assert stat.S_IMODE((area / "a").stat().st_mode) & 0o022 == 0
    assert ClockStateStore.open(area / "absent", create=False) is None and not (area / "absent").exists()


def test_links_in_trusted_folders_are_followed(area):
    real = area / "real"
    real.mkdir()
    (area / "alias").symlink_to(real)  # root's link in root's 0755 folder: like /var/run -> /run
    with ClockStateStore.open(area / "alias" / "store", create=True) as store:
        store.write(LockRecord.from_json(record("GPU-1")))
    assert (real / "store" / "GPU-1.json").is_file()


def test_a_group_writable_folder_on_the_way_is_refused(area):
    shared = area / "shared"
    shared.mkdir()
    os.chmod(shared, 0o775)
    with pytest.raises(StateStoreError, match=r"writable by group or others without the sticky bit \(mode 0775\)"):
        ClockStateStore.open(shared / "store", create=True)
    assert not (shared / "store").exists()


def test_printable_escapes_control_characters():
    assert printable("GPU-1\nforged\x1b[2J") == "GPU-1\\nforged\\x1b[2J"
    assert len(printable("x" * 1000, 50)) == 50


def test_a_bad_state_dir_for_reset_clocks_is_one_line_with_status_4(area, double, capsys):
    f = area / "file"
    f.write_text("")
    assert main(["reset-clocks", "--state-dir", str(f / "store")]) == 4
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "is a regular file, not a folder" in err[0]


def test_reset_all_resets_every_gpu_even_when_the_store_is_refused(area, double, attacker):
    """`--all` needs no state file: a refused store only means its files are not removed (said once)."""
    theirs = area / "vartmp" / "megatron-envpipe"
    attacker("mkdir", str(theirs), check=True)
    double.set_gpu(double.gpus[1].uuid, locked=[900, 900])
    done = repair_as_root(area, double, "--all", "--state-dir", str(theirs / "locked-clocks"))
    assert done.returncode == 0, done.stderr
    assert double.reload().gpus[1].locked is None
    (note,) = [ln for ln in done.stdout.splitlines() if "state files not removed" in ln]
    assert "owned by uid 65534" in note and list(theirs.iterdir()) == []

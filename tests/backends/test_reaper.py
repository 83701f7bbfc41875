"""The Reaper's watcher removes the folders of secret files of a parent killed with SIGKILL
(roving.backends.reaper, reaper_main): the local backend's, end to end, and, fed lines as a parent writes
them, only folders it can prove are the ones the parent named — never a link, another user's folder, a
folder made since under the name, or one not named as roving names them."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from helpers_core import PROGRAMS, ROOT, wait_until
from roving.backends.reaper import watcher_command


def _watch(folders: list, gone: list = ()) -> subprocess.CompletedProcess:
    """Run the watcher as a parent's Reaper does, tell it of ``folders`` (then that ``gone`` were removed),
    and end its input as a parent's death does; returns once it has exited."""
    lines = ["{}"]  # the parent's configuration: not read when there are no jobs to cancel
    for path in folders:
        st = os.lstat(path)
        lines.append("d+" + json.dumps([st.st_dev, st.st_ino, str(path)]))
    lines += ["d-" + json.dumps(str(path)) for path in gone]
    return subprocess.run(watcher_command("local"), input="\n".join(lines) + "\n", capture_output=True, text=True,
                          timeout=60)


def _secret_folder(where: Path, name: str = "roving-secrets-abc123") -> Path:
    folder = where / name
    folder.mkdir(mode=0o700)
    (folder / "0123.secret").write_text("the session secret")
    return folder


def test_a_local_parent_killed_with_sigkill_leaves_no_secret_folder(tmp_path):
    tmp = tmp_path / "tmp"  # the parent's temporary folder, where the local backend keeps its secret files
    tmp.mkdir()
    out = tmp_path / "jobs.txt"
    env = {**os.environ, "TMPDIR": str(tmp)}
    env.pop("ROVING_CHILD", None)
    parent = subprocess.Popen([sys.executable, str(PROGRAMS / "backend_parent.py"), str(out), "local", "2", "{}"],
                              cwd=str(ROOT), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_until(lambda: out.exists() or parent.poll() is not None, 120), "the parent did not start"
        assert out.exists(), parent.communicate(timeout=30)
        (folder,) = tmp.glob("roving-secrets-*")  # its children are running: the folder is there
        parent.send_signal(signal.SIGKILL)
        parent.wait(30)
        assert wait_until(lambda: not folder.exists(), 15), f"{folder} left: {list(folder.iterdir())}"
    finally:
        if parent.poll() is None:
            parent.kill()
        parent.communicate(timeout=30)


def test_the_watcher_removes_the_folders_it_was_told_of_and_not_those_it_was_told_are_gone(tmp_path):
    named, docker_named, gone = (_secret_folder(tmp_path, n) for n in
                                 ("roving-secrets-a1", "roving-secret-b2", "roving-secrets-c3"))
    done = _watch([named, docker_named, gone], gone=[gone])
    assert done.returncode == 0, done.stderr
    assert not named.exists() and not docker_named.exists()
    assert gone.exists()  # the parent said it removed it: what is there now is not the watcher's to remove


def test_a_folder_made_since_under_the_name_is_left_alone(tmp_path):
    folder = _secret_folder(tmp_path)
    st = os.lstat(folder)
    (folder / "0123.secret").unlink()
    folder.rmdir()
    folder.mkdir(mode=0o700)  # the same name, another folder (another inode)
    (folder / "theirs").write_text("kept")
    if os.lstat(folder).st_ino == st.st_ino:  # the file system gave the inode back: make it another one
        other = tmp_path / "other"
        other.mkdir()
        folder.rename(tmp_path / "moved")
        other.rename(folder)
    line = "d+" + json.dumps([st.st_dev, st.st_ino, str(folder)])
    done = subprocess.run(watcher_command("local"), input="{}\n" + line + "\n", capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert folder.exists()


def test_a_link_planted_in_place_of_the_folder_or_inside_it_is_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("precious")
    folder = _secret_folder(tmp_path)
    (folder / "planted").symlink_to(victim / "precious.txt")
    (folder / "planted-dir").symlink_to(victim)
    done = _watch([folder])
    assert done.returncode == 0, done.stderr
    assert not folder.exists() and (victim / "precious.txt").read_text() == "precious"
    # the folder replaced by a link to another: told of the folder, the watcher finds a link and leaves it
    folder = _secret_folder(tmp_path, "roving-secrets-d4")
    st = os.lstat(victim)
    os.rename(folder, tmp_path / "aside")
    folder.symlink_to(victim)
    line = "d+" + json.dumps([st.st_dev, st.st_ino, str(folder)])  # even the target's own identity
    done = subprocess.run(watcher_command("local"), input="{}\n" + line + "\n", capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert folder.is_symlink() and (victim / "precious.txt").read_text() == "precious"


def test_another_users_folder_or_one_not_named_as_roving_names_them_is_left_alone(tmp_path):
    theirs = _secret_folder(tmp_path, "roving-secrets-e5")
    os.chown(theirs, 65534, 65534)  # nobody's
    unnamed = _secret_folder(tmp_path, "my-project")
    done = _watch([theirs, unnamed])
    assert done.returncode == 0, done.stderr
    assert (theirs / "0123.secret").exists() and (unnamed / "0123.secret").exists()

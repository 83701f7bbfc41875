"""Log files, checkpoints being written and control files (issue 31): no symbolic link followed, made
private, and anything already there that is not private refused with an error that names it.
"""
from __future__ import annotations

import os
import stat

import pytest

import helpers_targets as h
import roving
from helpers_core import TIMEOUT, finish
from roving.system.private import NotPrivateError, create_private, open_private, private_dir
from roving.pipeline.runtime import checkpoint_file
from roving.pipeline.runtime import control


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_log_file_planted_as_a_symbolic_link_is_refused_and_its_target_untouched(tmp_path):
    target = tmp_path / "victim.txt"
    target.write_text("precious\n")
    logs = tmp_path / "logs"
    private_dir(str(logs))
    os.symlink(target, logs / "planted.log")
    with pytest.raises(NotPrivateError, match="planted.log: it is a symbolic link"):
        open_private(str(logs / "planted.log"))
    assert target.read_text() == "precious\n"


def test_a_child_whose_log_file_is_a_planted_link_is_not_started_and_the_link_is_not_followed(tmp_path):
    target = tmp_path / "victim.txt"
    target.write_text("precious\n")
    logs = tmp_path / "logs"
    private_dir(str(logs))
    os.symlink(target, logs / "linked.log")
    roving.init(child_output="files", log_dir=str(logs))
    out = roving.Queue()
    p = roving.Process(target=h.put_value, args=(out, "ran"), name="linked")
    with pytest.raises(NotPrivateError, match="linked.log: it is a symbolic link"):
        p.start()
    assert target.read_text() == "precious\n"
    os.unlink(logs / "linked.log")  # the Process can still be started once the link is gone
    p.start()
    assert out.get(timeout=TIMEOUT) == "ran"
    finish(p)
    assert _mode(logs / "linked.log") == 0o600


@pytest.mark.parametrize("how", ["another user's folder", "a link to another user's folder"])
def test_a_log_folder_whose_name_another_user_took_first_gives_way_to_a_private_folder_of_ones_own(
        tmp_path, caplog, how):
    logs, theirs = tmp_path / "roving-logs", tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)  # nobody's
    if how == "a link to another user's folder":
        os.symlink(theirs, logs)
    else:
        os.rename(theirs, logs)
    roving.init(child_output="files", log_dir=str(logs))
    procs = [roving.Process(target=h.print_lines, args=([f"from {i}"], []), name=f"logged-{i}") for i in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        finish(p)
    (own,) = [d for d in tmp_path.iterdir() if d.name.startswith("roving-logs-")]  # one for the whole process
    assert own.is_dir() and not own.is_symlink() and os.lstat(own).st_uid == os.getuid() and _mode(own) == 0o700
    assert [(own / f"logged-{i}.log").read_text() for i in range(2)] == ["from 0\n", "from 1\n"]
    assert list(logs.iterdir()) == []  # nothing written where the other user's name points
    assert f"roving refuses {logs}" in caplog.text and f"uses a folder of its own instead: {own}" in caplog.text


def test_a_log_folder_that_is_a_link_or_writable_by_others_is_refused(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    os.chmod(real, 0o700)
    os.symlink(real, tmp_path / "link")
    with pytest.raises(NotPrivateError, match="link: the folder is a symbolic link"):
        open_private(str(tmp_path / "link" / "a.log"))
    assert list(real.iterdir()) == []
    os.chmod(real, 0o777)
    with pytest.raises(NotPrivateError, match=r"others may write to the folder \(mode 0777\).*chmod go-w"):
        open_private(str(real / "a.log"))
    assert list(real.iterdir()) == []


def test_an_existing_log_file_others_may_read_is_refused_and_a_private_one_appended_to(tmp_path):
    private_dir(str(tmp_path / "logs"))
    loose = tmp_path / "logs" / "loose.log"
    loose.write_text("old\n")
    os.chmod(loose, 0o644)
    with pytest.raises(NotPrivateError, match=r"loose.log: group or others may read or write it \(mode 0644\)"):
        open_private(str(loose))
    os.chmod(loose, 0o600)
    with open_private(str(loose), "a") as f:
        f.write("new\n")
    assert loose.read_text() == "old\nnew\n"


def test_new_files_and_folders_are_private_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        with open_private(str(tmp_path / "a" / "b" / "c.log")) as f:
            f.write(b"x")
        with create_private(str(tmp_path / "a" / "d.tmp")) as f:
            f.write(b"y")
    finally:
        os.umask(old)
    assert _mode(tmp_path / "a") == _mode(tmp_path / "a" / "b") == 0o700
    assert _mode(tmp_path / "a" / "b" / "c.log") == _mode(tmp_path / "a" / "d.tmp") == 0o600


def test_a_temporary_name_planted_as_a_link_is_refused_and_a_stale_one_of_ours_replaced(tmp_path):
    folder = tmp_path / "ckpt"
    private_dir(str(folder))
    target = tmp_path / "victim.txt"
    target.write_text("precious\n")
    os.symlink(target, folder / "model.pt.tmp")
    with pytest.raises(NotPrivateError, match="model.pt.tmp: it is a symbolic link"):
        checkpoint_file.save({"step": 1}, folder / "model.pt")
    assert target.read_text() == "precious\n" and not (folder / "model.pt").exists()
    os.unlink(folder / "model.pt.tmp")
    (folder / "model.pt.tmp").write_text("left by a save that was cut short")
    os.chmod(folder / "model.pt.tmp", 0o644)
    checkpoint_file.save({"step": 2}, folder / "model.pt")
    assert checkpoint_file.read(folder / "model.pt") == {"step": 2}
    assert _mode(folder / "model.pt") == 0o600


def test_the_control_folder_is_made_private_and_a_planted_status_link_is_not_followed(tmp_path):
    folder = control.ControlFolder(tmp_path / "control")
    folder.record(control.EVENTS, {"event": "start"})
    assert _mode(folder.path) == 0o700 and _mode(folder.path / control.EVENTS) == 0o600
    target = tmp_path / "victim.txt"
    target.write_text("precious\n")
    # where this process writes status.json before renaming it into place
    os.symlink(target, folder.path / f"{control.STATUS}.{os.getpid()}.tmp")
    with pytest.raises(NotPrivateError, match=r"\.tmp: it is a symbolic link"):
        folder.write_status({"iterations": [], "events": []}, 1, {}, [], [], False)
    assert target.read_text() == "precious\n"
    os.symlink(target, folder.path / "iterations-link.jsonl")
    with pytest.raises(OSError):  # a planted link is not read through either
        folder.read_json("iterations-link.jsonl")


def test_checkpoints_are_refused_on_torch_older_than_2_6_with_the_reason(tmp_path, monkeypatch):
    checkpoint_file.save({"step": 1}, tmp_path / "model.pt")
    monkeypatch.setattr(checkpoint_file.torch, "__version__", "2.5.1+cpu")
    with pytest.raises(checkpoint_file.CheckpointFileError, match=r"torch 2\.5\.1\+cpu.*CVE-2025-32434.*torch>=2\.6"):
        checkpoint_file.read(tmp_path / "model.pt")

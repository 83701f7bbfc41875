"""The program's own modules reach children that do not share this machine's filesystem (roving.codeship,
``ship_code``): the archive's contents and limit, its unpacking, and programs importing a helper module of
their own on the real Docker engine with no volume for the working directory, and on the FAKE Kubernetes
API server (tests/support/fake_k8s: its pods are local processes, so there the proof is where the child
found the module: in the unpacked copy)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import helpers_backends as hb
import roving
from roving import codeship

SHIPPED = Path(__file__).resolve().parents[1] / "support" / "programs" / "shipped"
ROVING_SRC = str(Path(roving.__file__).resolve().parents[1])


def _names(archive: codeship.Archive) -> set:
    import io
    import tarfile

    with tarfile.open(fileobj=io.BytesIO(archive.data), mode="r:gz") as tar:
        return {m.name for m in tar.getmembers() if m.isfile()}


def _tree(root: Path, files: dict) -> None:
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())


def test_an_archive_leaves_out_git_caches_venvs_and_what_gitignore_names(tmp_path):
    _tree(tmp_path, {"main.py": "x", "pkg/mod.py": "y", "pkg/__pycache__/mod.cpython-311.pyc": "c",
                     ".git/HEAD": "ref", "data/big.bin": "z", "notes.log": "l", ".gitignore": "data/\n*.log\n",
                     "venv/pyvenv.cfg": "home", "venv/lib/site.py": "s"})
    archive = codeship.pack([str(tmp_path)], 1 << 20)
    assert _names(archive) == {"0/main.py", "0/pkg/mod.py"}
    assert archive.sha256 == hashlib.sha256(archive.data).hexdigest()
    assert codeship.pack([str(tmp_path)], 1 << 20).sha256 == archive.sha256  # the same files, the same archive


def test_in_a_git_repository_the_archive_holds_what_git_does_not_ignore(tmp_path):
    _tree(tmp_path, {"a.py": "a", "untracked.py": "u", "out/result.bin": "r", ".gitignore": "/out/\n"})
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True, timeout=30)
    subprocess.run(["git", "-C", str(tmp_path), "add", "a.py", ".gitignore"], check=True, timeout=30)
    assert _names(codeship.pack([str(tmp_path)], 1 << 20)) == {"0/a.py", "0/untracked.py"}


#: A program's folder as a home folder holds it: keys, credentials, notes, beside the program's code.
CLUTTERED = {"main.py": "m", "ext.cpython-311-x86_64-linux-gnu.so": b"\x7fELF", "pkg/__init__.py": "",
             "pkg/templates/page.html": "<p>", "pkg/.env": "TOKEN=1", "pkg/sub/mod.py": "",
             "pkg-1.0.dist-info/METADATA": "Name: pkg", ".ssh/id_ed25519": "PRIVATE KEY", ".kube/config": "token",
             ".env": "AWS_SECRET_ACCESS_KEY=x", ".roving/owner.key": "00" * 32, ".netrc": "machine x",
             "credentials.json": "{}", "notes.txt": "n", "photos/cat.jpg": b"jpg", "my-scripts/tool.py": "t"}
SHIPPED_OF_CLUTTERED = {"0/main.py", "0/ext.cpython-311-x86_64-linux-gnu.so", "0/pkg/__init__.py",
                        "0/pkg/templates/page.html", "0/pkg/sub/mod.py", "0/pkg-1.0.dist-info/METADATA"}


@pytest.mark.parametrize("with_git", [False, True])
def test_only_modules_and_package_data_are_shipped_never_a_dot_file_or_folder(tmp_path, with_git):
    _tree(tmp_path, CLUTTERED)
    if with_git:  # git lists dot-files it is not told to ignore: they are still left out
        subprocess.run(["git", "init", "-q", str(tmp_path)], check=True, timeout=30)
    assert _names(codeship.pack([str(tmp_path)], 1 << 20)) == SHIPPED_OF_CLUTTERED


def test_a_home_folder_or_one_that_holds_a_home_is_refused_naming_it_and_what_to_do(tmp_path, monkeypatch):
    import pwd

    home, alice = tmp_path / "me", tmp_path / "alice"
    _tree(home, {"main.py": "m"})
    _tree(alice, {"main.py": "m"})
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setattr(codeship.pwd, "getpwall",
                        lambda: [pwd.struct_passwd(("alice", "x", 1001, 1001, "", str(alice), "/bin/sh"))])
    with pytest.raises(codeship.CodeShipError) as caught:
        codeship.pack([str(home)], 1 << 20)
    assert f"refuses to ship {home} to the workers: it is the home folder of this user ($HOME)" in str(caught.value)
    assert "Run the program from a folder of its own" in str(caught.value)
    with pytest.raises(codeship.CodeShipError, match="it is the home folder of user alice"):
        codeship.pack([str(tmp_path / "elsewhere"), str(alice)], 1 << 20)
    with pytest.raises(codeship.CodeShipError, match=f"a folder that holds the home folder of user alice \\({alice}"):
        codeship.pack([str(tmp_path)], 1 << 20)
    _tree(home / "project", {"main.py": "m"})  # a folder inside a home is the program's own
    assert _names(codeship.pack([str(home / "project")], 1 << 20)) == {"0/main.py"}


def test_a_folder_inside_another_is_packed_once_and_placed_within_it(tmp_path):
    _tree(tmp_path, {"src/pkg/__init__.py": "", "run.py": ""})
    archive = codeship.pack([str(tmp_path / "src"), str(tmp_path)], 1 << 20)
    assert archive.places == ("0/src", "0") and _names(archive) == {"0/src/pkg/__init__.py", "0/run.py"}


def test_an_archive_over_the_limit_is_an_error_naming_the_biggest_files(tmp_path):
    # data inside a package is shipped (the package's data); at the folder's top it is not
    _tree(tmp_path, {"main.py": "x", "model/__init__.py": "", "model/weights.pt": b"w" * 3_000_000,
                     "model/frames.npy": b"f" * 1_500_000, "top.bin": b"t" * 9_000_000})
    with pytest.raises(codeship.CodeShipError) as caught:
        codeship.pack([str(tmp_path)], 2 << 20)
    message = str(caught.value)
    assert "comes to 4.3 MiB, over ship_code_limit=2.0 MiB" in message and "top.bin" not in message
    assert message.index("weights.pt (2.9 MiB)") < message.index("frames.npy (1.4 MiB)")


def test_unpacking_checks_the_digest_and_keeps_to_a_private_folder(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    _tree(tmp_path / "prog", {"m.py": "v = 1\n"})
    archive = codeship.pack([str(tmp_path / "prog")], 1 << 20)
    with pytest.raises(codeship.CodeShipError, match="does not match its digest"):
        codeship.install(archive.data + b"x", archive.sha256)
    target = codeship.install(archive.data, archive.sha256)
    assert (Path(target) / "0" / "m.py").read_text() == "v = 1\n"
    assert codeship.cached(archive.sha256) == target and codeship.install(archive.data, archive.sha256) == target
    root = Path(target).parent
    assert root.stat().st_mode & 0o777 == 0o700
    with pytest.raises(codeship.CodeShipError, match="outside the unpacked code"):
        codeship.paths_in(target, ["0/../../elsewhere"])



def _taken_by_another(root: Path, how: str, elsewhere: Path) -> None:
    """Make ``root`` as another local user could have made it first: a folder of theirs, a link to a folder
    of theirs, or a folder anyone may write to."""
    if how == "link":
        elsewhere.mkdir()
        root.symlink_to(elsewhere)
    else:
        root.mkdir()
        root.chmod(0o777 if how == "open to all" else 0o755)
    if how != "open to all":
        os.chown(elsewhere if how == "link" else root, 65534, 65534, follow_symlinks=False)  # nobody's


@pytest.mark.parametrize("how", ["another user's folder", "link", "open to all"])
def test_a_code_folder_name_taken_by_another_user_falls_back_to_a_private_folder_of_ones_own(
        tmp_path, monkeypatch, caplog, how):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    root = tmp_path / f"roving-code-{os.getuid()}"
    _taken_by_another(root, how, tmp_path / "elsewhere")
    _tree(tmp_path / "prog", {"m.py": "v = 2\n"})
    archive = codeship.pack([str(tmp_path / "prog")], 1 << 20)
    target = Path(codeship.install(archive.data, archive.sha256))
    assert (target / "0" / "m.py").read_text() == "v = 2\n"
    own = target.parent
    assert own.parent == tmp_path and own.name.startswith(f"roving-code-{os.getuid()}-")
    st = own.lstat()
    assert own.is_dir() and not own.is_symlink() and st.st_uid == os.getuid() and st.st_mode & 0o777 == 0o700
    assert codeship.cached(archive.sha256) == str(target)  # one folder for the whole process
    assert f"roving refuses {root}" in caplog.text and f"uses a folder of its own instead: {own}" in caplog.text
    # nothing was written where the other user's name points
    assert list(root.iterdir() if how != "link" else (tmp_path / "elsewhere").iterdir()) == []


def _copy_program(tmp_path: Path) -> Path:
    program = tmp_path / "program"
    shutil.copytree(SHIPPED, program)
    return program


def _run(program: Path, options: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    # the program runs from its own folder, outside any checkout; roving comes from this one's src
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = ROVING_SRC
    return subprocess.run([sys.executable, str(program / "main.py"), json.dumps(options)], cwd=program, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _docker_options() -> dict:
    options = hb.docker_options()
    # the image, the host's Python and roving's source; not the program's folder
    return {**options, "backend": "docker", "docker_mount_cwd": False,
            "docker_volumes": [*options["docker_volumes"], f"{ROVING_SRC}:{ROVING_SRC}:ro"]}


def test_on_docker_without_the_working_directory_a_program_importing_its_own_helper_runs(tmp_path):
    hb.require("docker")
    program = _copy_program(tmp_path)
    done = _run(program, _docker_options())
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["squares"] == [x * x for x in range(6)] and seen["exitcode"] == 0
    for found in [*seen["pool_found"], seen["process_found"]]:
        assert "/roving-code-" in found and found.endswith("/helper.py"), found
    # and with shipping off, the container cannot find the helper: the test above is not a shared folder
    done = _run(program, {**_docker_options(), "ship_code": "off", "pool_start_failures": 1}, timeout=120)
    assert done.returncode != 0 and "No module named 'helper'" in done.stdout + done.stderr


def test_on_docker_an_over_size_working_directory_is_an_error_naming_the_biggest_file(tmp_path):
    hb.require("docker")
    program = _copy_program(tmp_path)
    _tree(program, {"models/__init__.py": "", "models/checkpoint.pt": b"0" * 3_000_000})
    done = _run(program, {**_docker_options(), "ship_code_limit": "1M"}, timeout=120)
    assert done.returncode != 0
    assert "over ship_code_limit=1.0 MiB" in done.stderr and "checkpoint.pt (2.9 MiB)" in done.stderr


def test_on_the_fake_kubernetes_children_run_where_another_user_took_the_code_folders_name(tmp_path):
    from fake_k8s.server import FakeKubernetes

    program = _copy_program(tmp_path)
    shared_tmp = tmp_path / "tmp"  # the pods' temporary folder (TMPDIR, passed on with forward_env)
    shared_tmp.mkdir()
    _taken_by_another(shared_tmp / f"roving-code-{os.getuid()}", "another user's folder", tmp_path / "unused")
    with FakeKubernetes(cpu=8, memory=8 * 2**30) as fake:
        env_options = {"backend": "kubernetes", "image": "fake/roving:test", "forward_env": ["TMPDIR"]}
        kubeconfig = fake.kubeconfig(str(tmp_path / "kubeconfig"))
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "POD_NAME")}
        env.update(PYTHONPATH=ROVING_SRC, KUBECONFIG=kubeconfig, TMPDIR=str(shared_tmp))
        done = subprocess.run([sys.executable, str(program / "main.py"), json.dumps(env_options)], cwd=program,
                              env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["squares"] == [x * x for x in range(6)]
    for found in [*seen["pool_found"], seen["process_found"]]:
        assert found.startswith(f"{shared_tmp}/roving-code-{os.getuid()}-") and found.endswith("/helper.py"), found
    assert f"roving refuses {shared_tmp}/roving-code-{os.getuid()}" in done.stdout + done.stderr


def test_on_the_fake_kubernetes_a_program_importing_its_own_helper_gets_it_shipped(tmp_path):
    from fake_k8s.server import FakeKubernetes

    program = _copy_program(tmp_path)
    _tree(program, {".env": "API_TOKEN=do-not-ship", ".ssh/id_ed25519": "PRIVATE KEY", "notes.txt": "n"})
    with FakeKubernetes(cpu=8, memory=8 * 2**30) as fake:
        env_options = {"backend": "kubernetes", "image": "fake/roving:test"}
        kubeconfig = fake.kubeconfig(str(tmp_path / "kubeconfig"))
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "POD_NAME")}
        env.update(PYTHONPATH=ROVING_SRC, KUBECONFIG=kubeconfig)
        done = subprocess.run([sys.executable, str(program / "main.py"), json.dumps(env_options)], cwd=program,
                              env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["squares"] == [x * x for x in range(6)]
    assert seen["parent_found"] == str(program / "helper.py")
    for found in [*seen["pool_found"], seen["process_found"]]:
        assert "/roving-code-" in found and found.endswith("/helper.py"), found
    # the fake's pods are processes of this machine: the copy they unpacked is here to look at
    unpacked = Path(seen["process_found"]).parent
    assert sorted(p.name for p in unpacked.iterdir() if p.name != "__pycache__") == ["helper.py", "main.py"]

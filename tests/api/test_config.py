"""Configuration: init() over ROVING_* env over roving.toml / [tool.roving] over defaults; errors name key and
source."""
from __future__ import annotations

import pytest

import helpers_targets as h
import roving
from helpers_core import TIMEOUT
from roving import config
from roving.config import ConfigError, load


def write_pyproject(tmp_path, body):
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n\n[tool.roving]\n" + body)


def test_defaults_without_file_env_or_overrides(tmp_path):
    cfg = load(cwd=str(tmp_path), environ={})
    assert cfg == config.Config()
    assert cfg.backend == "local" and cfg.child_output == "prefix" and cfg.host == "auto" and cfg.advertise == "auto"


def test_pyproject_tool_roving_table_overrides_defaults(tmp_path):
    write_pyproject(tmp_path, "child_output = 'files'\nheartbeat_interval = 0.5\n")
    cfg = load(cwd=str(tmp_path), environ={})
    assert cfg.child_output == "files" and cfg.heartbeat_interval == 0.5
    assert cfg.parent_timeout == config.Config().parent_timeout


def test_roving_toml_overrides_defaults(tmp_path):
    (tmp_path / "roving.toml").write_text("log_dir = 'my-logs'\nparent_timeout = 9\n")
    cfg = load(cwd=str(tmp_path), environ={})
    assert cfg.log_dir == "my-logs" and cfg.parent_timeout == 9.0


def test_environment_overrides_file(tmp_path):
    write_pyproject(tmp_path, "child_output = 'files'\nlog_dir = 'from-file'\n")
    cfg = load(cwd=str(tmp_path), environ={"ROVING_CHILD_OUTPUT": "off", "ROVING_HEARTBEAT_INTERVAL": "0.25"})
    assert cfg.child_output == "off"  # env wins over the file
    assert cfg.heartbeat_interval == 0.25  # env strings are converted
    assert cfg.log_dir == "from-file"  # what env does not set comes from the file


def test_init_overrides_environment_and_file(tmp_path):
    (tmp_path / "roving.toml").write_text("child_output = 'files'\nlog_dir = 'from-file'\n")
    env = {"ROVING_CHILD_OUTPUT": "off", "ROVING_PARENT_TIMEOUT": "7"}
    cfg = load({"child_output": "prefix"}, cwd=str(tmp_path), environ=env)
    assert cfg.child_output == "prefix"
    assert cfg.parent_timeout == 7.0
    assert cfg.log_dir == "from-file"


def test_unknown_key_in_init_names_key_and_source():
    with pytest.raises(ConfigError) as info:
        load({"no_such_option": 1}, environ={})
    assert "no_such_option" in str(info.value) and "roving.init()" in str(info.value)


def test_unknown_key_in_environment_names_variable():
    with pytest.raises(ConfigError) as info:
        load(environ={"ROVING_BOGUS": "1"})
    assert "ROVING_BOGUS" in str(info.value)


def test_unknown_key_in_pyproject_names_key_and_file(tmp_path):
    write_pyproject(tmp_path, "colour = 'blue'\n")
    with pytest.raises(ConfigError) as info:
        load(cwd=str(tmp_path), environ={})
    message = str(info.value)
    assert "colour" in message and "pyproject.toml" in message and "tool.roving" in message


def test_unknown_key_in_roving_toml_names_key_and_file(tmp_path):
    (tmp_path / "roving.toml").write_text("nope = true\n")
    with pytest.raises(ConfigError) as info:
        load(cwd=str(tmp_path), environ={})
    assert "nope" in str(info.value) and "roving.toml" in str(info.value)


@pytest.mark.parametrize("key,value", [("child_output", "loud"), ("backend", "nowhere"),
                                       ("heartbeat_interval", "soon"), ("parent_timeout", -1),
                                       ("connect_timeout", 0)])
def test_bad_value_from_init_names_key_and_source(key, value):
    with pytest.raises(ConfigError) as info:
        load({key: value}, environ={})
    assert key in str(info.value) and "roving.init()" in str(info.value)


def test_bad_value_from_environment_names_variable():
    with pytest.raises(ConfigError) as info:
        load(environ={"ROVING_HEARTBEAT_INTERVAL": "often"})
    assert "heartbeat_interval" in str(info.value) and "ROVING_HEARTBEAT_INTERVAL" in str(info.value)


def test_bad_value_from_file_names_key_and_file(tmp_path):
    (tmp_path / "roving.toml").write_text("child_output = 'everywhere'\n")
    with pytest.raises(ConfigError) as info:
        load(cwd=str(tmp_path), environ={})
    assert "child_output" in str(info.value) and "roving.toml" in str(info.value)


def test_invalid_roving_toml_is_a_config_error(tmp_path):
    (tmp_path / "roving.toml").write_text("this is = = not toml\n")
    with pytest.raises(ConfigError) as info:
        load(cwd=str(tmp_path), environ={})
    assert "roving.toml" in str(info.value)


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)
    assert roving.ConfigError is ConfigError


def test_roving_child_variable_is_not_taken_for_an_option():
    cfg = load(environ={"ROVING_CHILD": "{}"})
    assert cfg == load(environ={})


def test_init_sets_the_current_config_and_a_bad_init_leaves_it_unchanged():
    cfg = roving.init(heartbeat_interval=0.5)
    assert config.current() is cfg and cfg.heartbeat_interval == 0.5
    with pytest.raises(ConfigError):
        roving.init(heartbeat_interval="never")
    assert config.current() is cfg


def test_a_first_use_resolving_in_another_thread_does_not_undo_an_init_made_meanwhile(monkeypatch):
    """A thread that resolves the configuration on first use (a slow load: the backend's detector looks
    at the machine) while init() runs must not put its older result over init()'s."""
    import threading

    config._current = None
    loading, release = threading.Event(), threading.Event()
    real = config.load

    def slow_load(*args, **kwargs):
        if threading.current_thread().name == "first-use":
            loading.set()
            assert release.wait(TIMEOUT)
        return real(*args, **kwargs)

    monkeypatch.setattr(config, "load", slow_load)
    seen = []
    first = threading.Thread(target=lambda: seen.append(config.current()), name="first-use")
    first.start()
    assert loading.wait(TIMEOUT)
    cfg = roving.init(heartbeat_interval=0.5)
    release.set()
    first.join(TIMEOUT)
    assert config.current() is cfg and seen == [cfg]


def test_child_receives_the_parents_resolved_config():
    roving.init(heartbeat_interval=0.7, parent_timeout=6.5, child_output="prefix")
    q = roving.Queue()
    p = roving.Process(target=h.report_config, args=(q,))
    p.start()
    assert q.get(timeout=TIMEOUT) == {"heartbeat_interval": 0.7, "parent_timeout": 6.5,
                                      "child_output": "prefix"}
    p.join(TIMEOUT)
    assert p.exitcode == 0


def test_init_calls_add_up_and_a_later_value_wins():
    roving.init(heartbeat_interval=0.5)
    cfg = roving.init(parent_timeout=7)
    assert cfg.heartbeat_interval == 0.5 and cfg.parent_timeout == 7.0
    cfg = roving.init(heartbeat_interval=0.25)
    assert cfg.heartbeat_interval == 0.25 and cfg.parent_timeout == 7.0


def test_a_rejected_init_keeps_earlier_init_options():
    roving.init(parent_timeout=7)
    with pytest.raises(roving.ConfigError):
        roving.init(no_such_option=1)
    assert roving.init().parent_timeout == 7.0


def test_forward_env_is_a_tuple_of_names_from_a_list_or_a_comma_separated_string(tmp_path):
    assert load(cwd=str(tmp_path), environ={}).forward_env == ()
    cfg = load(cwd=str(tmp_path), environ={"ROVING_FORWARD_ENV": "HF_TOKEN, WANDB_API_KEY"})
    assert cfg.forward_env == ("HF_TOKEN", "WANDB_API_KEY")
    (tmp_path / "roving.toml").write_text('forward_env = ["A", "B"]\n')
    assert load(cwd=str(tmp_path), environ={}).forward_env == ("A", "B")
    assert load({"forward_env": "C"}, cwd=str(tmp_path), environ={}).forward_env == ("C",)

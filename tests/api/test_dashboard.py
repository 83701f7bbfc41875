"""The live dashboard in a real headless Chromium: a Pool losing a worker mid-map, the token, /metrics."""
from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

import helpers_browser as hb
import roving
from helpers_core import TIMEOUT
from roving import dashboard

N_ITEMS = 40


def die_once(x, marker):
    """Item 5 kills its worker the first time (the marker file says it happened), later runs succeed."""
    time.sleep(0.05)
    if x == 5 and not os.path.exists(marker):
        with open(marker, "w") as f:
            f.write(str(time.time()))
        os._exit(3)
    return x * x


@pytest.fixture
def board():
    server = dashboard.start(announce=False)
    yield server


@pytest.fixture
def browser():
    driver = hb.chromium()
    yield driver
    driver.quit()


def _count(driver, pool_id, name):
    text = hb.text_of(driver, f"#pool-{pool_id} .count-{name}")
    return int(text) if text.strip() else None


def test_page_shows_a_lost_worker_and_its_retry_within_5_s_and_the_final_counts_exactly(board, browser, tmp_path):
    marker = str(tmp_path / "died")
    browser.get(board.url + "#pools")
    with roving.Pool(3) as pool:
        pool_id = pool._disp.pool_id
        result = pool.starmap_async(die_once, [(i, marker) for i in range(N_ITEMS)], chunksize=2)
        hb.wait_for(browser, "the pool's card", lambda: hb.text_of(browser, f"#pool-{pool_id}"), TIMEOUT,
                    tmp_path / "no-pool.png")
        deadline = time.monotonic() + TIMEOUT
        while not os.path.exists(marker):
            assert time.monotonic() < deadline, "item 5 never ran"
            time.sleep(0.02)
        killed = time.monotonic()
        hb.wait_for(browser, "the lost worker", lambda: (_count(browser, pool_id, "lost") or 0) >= 1, 5.0,
                    tmp_path / "no-loss.png")
        hb.wait_for(browser, "the retry event", lambda: browser.execute_script(
            f"return document.querySelectorAll('#pool-{pool_id} .pool-events .ev-retry').length") >= 1
            and (_count(browser, pool_id, "retried") or 0) >= 1, max(0.5, 5.0 - (time.monotonic() - killed)),
            tmp_path / "no-retry.png")
        assert result.get(TIMEOUT) == [i * i for i in range(N_ITEMS)]
        figures = pool._upkeep.figures()
        hb.wait_for(browser, "the final counts", lambda: _count(browser, pool_id, "done") == N_ITEMS, TIMEOUT,
                    tmp_path / "not-final.png")
        assert _count(browser, pool_id, "done") == N_ITEMS
        assert _count(browser, pool_id, "failed") == 0
        assert _count(browser, pool_id, "queued") == 0
        assert _count(browser, pool_id, "running") == 0
        assert _count(browser, pool_id, "lost") == 1
        # retried: the items the dead worker held, as the retry events count them, and no more
        retried_events = [e for e in roving.observe.events_since(0)
                          if e["kind"] == "retry" and e.get("pool") == pool_id]
        assert _count(browser, pool_id, "retried") == sum(e["items"] for e in retried_events) == figures["retried"] >= 1
        lost_text = hb.text_of(browser, f"#pool-{pool_id} .pool-events .ev-worker-lost")
        assert "exit code 3" in lost_text
        browser.save_screenshot(str(tmp_path / "pools.png"))
        browser.execute_script("document.querySelector('button[data-view=processes]').click()")
        hb.wait_for(browser, "the dead worker among the processes", lambda: browser.execute_script(
            "return [...document.querySelectorAll('tr.proc')].some(r => r.dataset.state === 'failed' "
            "&& r.textContent.includes('exited with code 3'))"), TIMEOUT, tmp_path / "no-proc.png")
        browser.save_screenshot(str(tmp_path / "processes.png"))


def test_a_task_exception_is_shown_with_its_traceback(board, browser, tmp_path):
    browser.get(board.url + "#events")
    with roving.Pool(1) as pool:
        with pytest.raises(ZeroDivisionError):
            pool.apply(divmod, (1, 0))
        pool_id = pool._disp.pool_id
        hb.wait_for(browser, "the failed task", lambda: browser.execute_script(
            "return [...document.querySelectorAll('#events .ev-task-failed')].some(e => "
            f"e.textContent.includes('pool {pool_id}') && e.textContent.includes('ZeroDivisionError'))"),
            TIMEOUT, tmp_path / "no-exception.png")
        # this pool's failure (the list is newest first, and may hold earlier tests' failures)
        tb = browser.execute_script(
            "const e = [...document.querySelectorAll('#events .ev-task-failed')].find(e => "
            f"e.textContent.includes('pool {pool_id}') && e.textContent.includes('ZeroDivisionError')); "
            "const pre = e && e.querySelector('pre'); return pre ? pre.textContent : ''")
        assert "Traceback" in tb and "ZeroDivisionError" in tb
        browser.save_screenshot(str(tmp_path / "events.png"))


def test_a_request_without_the_token_is_refused(board, browser, tmp_path):
    base = board.url.split("?")[0].rstrip("/")
    for path in ("/", "/api/state", "/metrics", "/app.js", "/nothing"):
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(base + path, timeout=TIMEOUT)
        assert err.value.code == 403, path
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(base + path + "?token=wrong" + board.token[5:], timeout=TIMEOUT)
        assert err.value.code == 403, path
    browser.get(base + "/")
    assert "403" in browser.find_element("tag name", "body").text
    browser.save_screenshot(str(tmp_path / "refused.png"))
    browser.get(board.url)  # the token once; the cookie afterwards
    hb.wait_for(browser, "the page", lambda: browser.execute_script("return document.body.dataset.updated"),
                TIMEOUT, tmp_path / "no-page.png")
    browser.get(base + "/api/state")
    assert '"runtime"' in browser.find_element("tag name", "body").text
    with urllib.request.urlopen(urllib.request.Request(base + "/metrics", headers={
            "Authorization": f"Bearer {board.token}"}), timeout=TIMEOUT) as r:
        assert r.status == 200 and "roving_processes" in r.read().decode()


def test_roving_dashboard_1_serves_from_the_main_process_only_and_prints_the_url_once(tmp_path):
    program = tmp_path / "prog.py"
    program.write_text(
        "import roving, urllib.request\n"
        "from roving import dashboard\n"
        "def child():\n"
        "    from roving import dashboard as d\n"
        "    assert d.current() is None, 'a child served a dashboard'\n"
        "if __name__ == '__main__':\n"
        "    p = roving.Process(target=child); p.start(); p.join(60); assert p.exitcode == 0, p.exitcode\n"
        "    s = dashboard.current()\n"
        "    body = urllib.request.urlopen(s.url.replace('/?', '/metrics?'), timeout=30).read().decode()\n"
        "    assert 'roving_processes{state=\"finished\"} 1.0' in body, body\n"
        "    print('OK')\n")
    env = {**os.environ, "ROVING_DASHBOARD": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("ROVING_CHILD", None)
    out = subprocess.run([sys.executable, str(program)], env=env, capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "OK"
    assert out.stderr.count("roving: dashboard at http://127.0.0.1:") == 1, out.stderr


def test_roving_run_dashboard_makes_the_program_serve_one(tmp_path):
    program = tmp_path / "prog.py"
    program.write_text(
        "import roving, urllib.request\n"
        "from roving import dashboard\n"
        "s = dashboard.current()\n"
        "assert s is not None, 'no dashboard'\n"
        "body = urllib.request.urlopen(s.url.replace('/?', '/api/state?'), timeout=30).read().decode()\n"
        "assert '\"runtime\"' in body\n"
        "print('SERVED')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for var in ("ROVING_CHILD", "ROVING_DASHBOARD"):
        env.pop(var, None)
    out = subprocess.run([sys.executable, "-m", "roving", "run", "--backend", "local", "--dashboard", str(program)],
                         env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "SERVED" in out.stdout
    assert (out.stdout + out.stderr).count("roving: dashboard at http://127.0.0.1:") == 1, out.stderr
    plain = subprocess.run([sys.executable, "-m", "roving", "run", "--backend", "local", str(program)],
                           env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert plain.returncode != 0 and "no dashboard" in plain.stderr


def test_beyond_loopback_the_dashboard_speaks_https_with_the_certificate_it_printed(tmp_path):
    import hashlib
    import socket
    import ssl

    from roving.dashboard import Server, Views

    assert Server(Views(), "127.0.0.1").fingerprint == ""  # loopback: plain HTTP unless asked
    server = Server(Views(), "127.0.0.1", tls=True).start()
    try:
        assert server.url.startswith("https://127.0.0.1:")
        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE  # self-signed: checked by fingerprint below
        with socket.create_connection((server.host, server.port), timeout=TIMEOUT) as raw:
            with ctx.wrap_socket(raw) as tls_sock:
                der = tls_sock.getpeercert(binary_form=True)
        digest = hashlib.sha256(der).hexdigest().upper()
        assert server.fingerprint.replace(":", "") == digest
        base = server.url.split("?")[0].rstrip("/")
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(base + "/metrics", timeout=TIMEOUT, context=ctx)
        assert err.value.code == 403
        with urllib.request.urlopen(server.url.replace("/?", "/metrics?"), timeout=TIMEOUT, context=ctx) as r:
            assert r.status == 200
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):  # no plain HTTP there
            urllib.request.urlopen(server.url.replace("https://", "http://"), timeout=TIMEOUT)
    finally:
        server.stop()


def test_a_bad_dashboard_option_is_an_error_naming_it():
    with pytest.raises(roving.ConfigError, match="dashboard_tls"):
        roving.init(dashboard_tls="maybe")
    with pytest.raises(roving.ConfigError, match="dashboard_port"):
        roving.init(dashboard_port="eighty")


def test_a_process_is_shown_with_its_recent_output_and_as_finished(board, browser, tmp_path):
    import helpers_targets as h

    name = "Talker-dashboard"
    p = roving.Process(target=h.print_lines, args=(["first line", "second line"], ["an error line"]), name=name)
    p.start()
    p.join(TIMEOUT)
    assert p.exitcode == 0
    browser.get(board.url + "#processes")
    row = f"tr.proc[data-name='{name}']"
    hb.wait_for(browser, "the finished process with its output", lambda: browser.execute_script(
        f"const r = document.querySelector(\"{row}\"); return r && r.dataset.state === 'finished' "
        "&& r.textContent.includes('3 line(s)') && r.textContent.includes('exited normally')"),
        TIMEOUT, tmp_path / "no-output.png")
    browser.execute_script(f"document.querySelector(\"{row} details\").open = true")
    text = hb.text_of(browser, f"{row} pre")
    assert "first line" in text and "second line" in text and "an error line" in text
    browser.save_screenshot(str(tmp_path / "output.png"))


def _metric(text, name, **labels):
    """The values of metric ``name`` whose labels include ``labels``."""
    import re

    out = []
    for line in text.splitlines():
        m = re.match(rf"^{name}\{{(.*)\}} (\S+)$", line)
        if m and all(f'{k}="{v}"' in m.group(1).split(",") for k, v in labels.items()):
            out.append(float(m.group(2)))
    return out


def test_each_workers_memory_and_peak_and_each_calls_peak_are_on_the_page_and_in_metrics(board, browser, tmp_path):
    import helpers_memory as hm

    roving.init(heartbeat_interval=0.1)
    browser.get(board.url + "#pools")
    with roving.Pool(1) as pool:
        pool_id = pool._disp.pool_id
        pool.apply(hm.use_for_a_while, (100, 1.0))
        base = board.url.split("?")[0].rstrip("/")
        with urllib.request.urlopen(urllib.request.Request(base + "/metrics", headers={
                "Authorization": f"Bearer {board.token}"}), timeout=TIMEOUT) as r:
            text = r.read().decode()
        peaks = _metric(text, "roving_pool_worker_peak_memory_bytes", pool=pool_id)
        assert len(peaks) == 1 and peaks[0] >= 100 * hm.MiB, text
        assert _metric(text, "roving_pool_worker_memory_bytes", pool=pool_id)[0] > 0
        calls = _metric(text, "roving_pool_call_peak_memory_bytes", pool=pool_id, function="use_for_a_while")
        assert len(calls) == 1 and calls[0] >= 100 * hm.MiB
        assert _metric(text, "roving_pool_workers_oom_killed_total", pool=pool_id) == [0.0]
        hb.wait_for(browser, "the worker's peak memory", lambda: hb.text_of(
            browser, f"#pool-{pool_id} td.peak-memory").endswith(("MiB", "GiB")), TIMEOUT, tmp_path / "no-peak.png")
        hb.wait_for(browser, "the call's peak memory", lambda: "use_for_a_while" in hb.text_of(
            browser, f"#pool-{pool_id} table.call-peaks"), TIMEOUT, tmp_path / "no-call-peak.png")
        browser.save_screenshot(str(tmp_path / "memory.png"))

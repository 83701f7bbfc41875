"""Markup in every field the dashboard shows (pools, workers, processes, output, events, tracebacks,
pipeline nodes, stages, regions, plan rows...) is shown as text in a real headless Chromium: no element
it carries is made, no handler of it runs, and the text reads as it was written."""
from __future__ import annotations

import json
import os

import pytest

import helpers_browser as hb
import helpers_targets as h
import roving
from helpers_core import TIMEOUT
from roving import observe
from roving.dashboard import Server, Views

POOL_ID = 990001  # far above the ids of the pools this process makes


def payload(field: str) -> str:
    """A value that is markup twice over: a script element, and an attribute break-out with a handler."""
    return (f"<script>document.title='xss {field}'</script>"
            f"\"'><img src=x onerror=\"document.title='xss {field}'\">{field}")


def raise_with(message):
    raise ValueError(message)


class _Owner:
    """Stands for a pool (observe keeps a weak reference to it)."""

    def figures(self):
        return {"state": payload("pool-state"), "size": payload("pool-size"), "min": payload("pool-min"),
                "max": payload("pool-max"),
                # counts stay numbers: they are computed, and /metrics (later tests read it) sums them
                "queued": 0, "running": 0, "done": 7, "failed": 0, "retried": 0, "lost": 0,
                "workers": [{"id": payload("worker-id"), "name": payload("worker-name"),
                             "state": payload("worker-state"), "items": payload("worker-items")}]}


VIEWS = {
    "pools": ["pool-state", "pool-size", "pool-min", "pool-max", "worker-id",
              "worker-name", "worker-state", "worker-items", "pool-event-text", "pool-event-traceback"],
    "processes": ["process-name", "backend", "host", "job", "resource-name", "resource-value", "cause", "output"],
    "events": ["event-kind", "event-source", "event-field-name", "event-field-value", "pool-event-text",
               "pool-event-traceback", "task-exception"],
    "pipeline": ["iterations-done", "iterations", "missing-stage", "node", "stage", "region", "dead-node",
                 "pipeline-event", "pipeline-event-field", "plan-iteration", "plan-row", "bar-kind", "bar-label",
                 "status-event"],
}

TOOLTIPS = {"bar-kind", "bar-label"}  # a Gantt bar's title: shown on hovering it, not in the page's text


def _control_folder(tmp_path):
    """A training's control folder whose every shown field is markup (its own name included)."""
    control = tmp_path / "run\"><img src=x onerror=alert(1)>"
    control.mkdir()
    p = payload
    (control / "status.json").write_text(json.dumps({
        "iterations_done": p("iterations-done"), "iterations": p("iterations"), "missing_stages": [p("missing-stage")],
        "nodes": {p("node"): p("stage")}, "regions": {p("node"): p("region")},
        "recent_events": [{"event": p("status-event"), "iteration": 1}]}))
    (control / "iterations.jsonl").write_text("".join(json.dumps({"iteration": i, "train_loss": 2.0 - i / 10,
                                                                  "seconds": 0.1}) + "\n" for i in range(5)))
    (control / "events.jsonl").write_text(
        json.dumps({"event": p("pipeline-event"), "iteration": 2, p("pipeline-event-field"): p("pipeline-event-field")})
        + "\n" + json.dumps({"event": "dead", "iteration": 3, "nodes": [p("dead-node")]}) + "\n"
        + json.dumps({"event": p("status-event"), "iteration": 1}) + "\n")
    bars = [[p("bar-kind"), p("bar-label"), 0.0, 1.0]]
    plan = {"iteration": p("plan-iteration"), "predicted": {p("plan-row"): bars}, "measured": {p("plan-row"): bars}}
    (control / "plan.json").write_text(json.dumps(plan))
    return control


@pytest.fixture
def hostile(tmp_path):
    """Every field the page shows, made markup: through observe (what the runtime publishes) and through a
    real process's output and a real task's exception."""
    p = payload
    owner = _Owner()
    observe.track_pool(POOL_ID, owner, owner.figures)
    observe.event("task-failed", f"pool {POOL_ID}", p("pool-event-text"), pool=POOL_ID,
                  traceback=p("pool-event-traceback"))
    observe.event(p("event-kind"), p("event-source"), "", **{p("event-field-name"): p("event-field-value")})
    observe.process_started("hostile-key", p("process-name"), p("backend"), p("job"),
                            {p("resource-name"): p("resource-value")}, host=p("host"))
    observe.output_lines(p("process-name"), [p("output")])
    observe.process_ended("hostile-key", 3, cause=p("cause"))
    talker = roving.Process(target=h.print_lines, args=([p("output")], []), name="Talker-escaping")
    talker.start()
    talker.join(TIMEOUT)
    assert talker.exitcode == 0
    with roving.Pool(1) as pool:
        with pytest.raises(ValueError):
            pool.apply(raise_with, (p("task-exception"),))
    views = Views()
    views.watch_pipeline(str(_control_folder(tmp_path)))
    server = Server(views).start()
    yield server, owner
    server.stop()


def test_markup_in_every_field_is_rendered_as_text_in_chromium(hostile, tmp_path):
    server, _owner = hostile
    driver = hb.chromium()
    try:
        driver.get(server.url)
        hb.wait_for(driver, "the page", lambda: driver.execute_script("return document.body.dataset.updated"),
                    TIMEOUT, tmp_path / "no-page.png")
        driver.execute_script("window.violations = []; document.addEventListener('securitypolicyviolation', "
                              "e => window.violations.push(e.violatedDirective + ' ' + e.sample))")
        for view, fields in VIEWS.items():
            driver.execute_script(f"document.querySelector('button[data-view={view}]').click()")
            section = f"view-{view}"

            def shown(section=section):
                # open every <details> (tracebacks, output), so that its text is in sight too
                return driver.execute_script(
                    "const v = document.getElementById(arguments[0]);"
                    "v.querySelectorAll('details:not([open])').forEach(d => { d.open = true; });"
                    "return v.innerText + '\\n' + v.textContent", section)

            def all_there(fields=fields):
                text = shown()
                return all(payload(f) in text for f in fields)

            hb.wait_for(driver, f"every field of the {view} view as text", all_there, TIMEOUT,
                        tmp_path / f"{view}.png")
            text = driver.execute_script("return document.getElementById(arguments[0]).innerText", section)
            missing = [f for f in fields if payload(f) not in text and f not in TOOLTIPS]
            assert not missing, f"not visible as text in the {view} view: {missing}"
            tips = driver.execute_script("return [...document.querySelectorAll('#view-' + arguments[0] + "
                                         "' svg title')].map(t => t.textContent).join('\\n')", view)
            assert all(payload(f) in tips for f in fields if f in TOOLTIPS), tips[:300]
            made = driver.execute_script(
                "return [...document.querySelectorAll('img, script, [onerror], iframe, object, embed')]"
                ".filter(e => !(e.tagName === 'SCRIPT' && e.getAttribute('src') === '/app.js'))"
                ".map(e => e.outerHTML.slice(0, 120))")
            assert made == [], f"the {view} view made elements from a field: {made}"
            driver.save_screenshot(str(tmp_path / f"{view}.png"))
        assert driver.title == "roving dashboard"
        assert driver.execute_script("return window.violations") == []
        # the control folder's name (a path with markup in it) is the pipeline card's title
        driver.execute_script("document.querySelector('button[data-view=pipeline]').click()")
        title = hb.text_of(driver, ".pipeline h2")
        assert os.path.basename(server.views.state()["pipelines"][0]["control"]) in title
    finally:
        driver.quit()

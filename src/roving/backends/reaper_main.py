"""The watcher program of :class:`roving.backends.reaper.Reaper`: ``python -m roving.backends.reaper_main NAME``.

Reads the parent's resolved configuration (one JSON line), then ``+ID`` / ``-ID`` lines as the parent
starts jobs and sees them end. When its input closes (the parent ended, however), it cancels the jobs
still listed with backend NAME, and exits. Ctrl-C is ignored (the parent's terminal may send it to
the whole group; the watcher must outlive the parent). Nothing imports this module.
"""
from __future__ import annotations

import json
import signal
import sys
from typing import Any, Dict

from .. import backends
from .. import config as _config


def main() -> int:
    """The watcher: read the configuration and the job ids until the input closes, then cancel."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    name = sys.argv[1]
    first = sys.stdin.readline()
    if not first:
        return 0
    live = {}
    for line in sys.stdin:
        line = line.strip()
        if line.startswith("+"):
            live[line[1:]] = True
        elif line.startswith("-"):
            live.pop(line[1:], None)
    if not live:
        return 0
    options = json.loads(first)
    fields: Dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}
    _config.adopt(_config.Config(**fields))
    backends.get(name).cancel_ids(list(live))
    return 0


if __name__ == "__main__":
    sys.exit(main())

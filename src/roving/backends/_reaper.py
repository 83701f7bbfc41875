"""The watcher process behind :class:`roving.backends.base.Reaper`: ``python -m roving.backends._reaper NAME``.

Reads the parent's resolved configuration (one JSON line), then ``+ID`` / ``-ID`` lines as the parent
starts jobs and sees them end. When its input closes (the parent ended, however), it cancels the jobs
still listed.
"""
from __future__ import annotations

import json
import signal
import sys


def main() -> int:
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
    from .. import backends
    from .. import config as _config

    options = json.loads(first)
    _config._adopt(_config.Config(**{k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}))
    backends.get(name).cancel_ids(list(live))
    return 0


if __name__ == "__main__":
    sys.exit(main())

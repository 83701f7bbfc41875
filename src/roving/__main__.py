"""``python -m roving``: the ``roving`` command (the same arguments, output and exit status)."""
import signal
import sys

from .cli import main

if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    sys.exit(main())

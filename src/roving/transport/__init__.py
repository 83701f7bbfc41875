"""The transport: authenticated ZeroMQ endpoints and streams, mailboxes and zero-copy serialization.

Its errors, one family under ``TransportError``: :mod:`roving.transport.errors`."""

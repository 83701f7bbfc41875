"""The transport: authenticated ZeroMQ endpoints, mailboxes and zero-copy serialization."""

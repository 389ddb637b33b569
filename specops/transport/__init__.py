"""The transport: SSH trust and connections, one host (shell, SFTP, tasks), the same step over many hosts,
one remote task (the entry script rendered, the bundle shipped by its content hash, the payload parsed),
and the trees an install carries to hosts."""

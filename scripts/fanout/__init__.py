"""`multislice run`: a command on every worker of every slice, launched detached, then polled.

command (the CLI), engine (launch, poll, stop), remote (the shell the workers run), workers (from
the TPU API or a hosts file), transports (ssh, gcloud, IAP), options.
"""

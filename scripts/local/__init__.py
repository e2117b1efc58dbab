"""`multislice local`: an emulated multislice job on CPU, one OS process per slice.

command (the CLI), supervisor (restarts, drills, the watchdog), attempt (one launch of every
slice), procs (child processes and their output).
"""

"""`multislice report`: goodput of a run. command (the CLI), goodput (the timeline), plot (PNG).
"""

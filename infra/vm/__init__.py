"""What runs on every TPU VM, not in the Pulumi program: startup.sh and launch.py.

Both travel in the queued resource's metadata and run on another machine, before any of this
project is installed there: startup.sh is bash, launch.py uses the standard library only.
"""

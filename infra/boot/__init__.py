"""The boot path every TPU VM and every GKE pod runs, not the Pulumi program: startup.sh and
launch.py.

Both travel with the slices (the queued resource's node metadata; the pods' boot ConfigMap) and
run on another machine before any of this project is installed there: startup.sh is bash,
launch.py uses the standard library only.
"""

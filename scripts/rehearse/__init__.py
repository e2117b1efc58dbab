"""`multislice rehearse`: a stack on emulated TPU VMs, or a GKE stack's JobSet on emulated pods.

command (the CLI and the TPU-VM rehearsal), jobset (a GKE stack's JobSet on emulated pods, its
controller and the loopback Kubernetes API), stack (what both share: the stack scaled to the
emulated machines, edits settled and applied as `pulumi up` would, logs tailed, events told).
"""

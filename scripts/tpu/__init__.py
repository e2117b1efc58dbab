"""The queued-resource commands: status, watch, reset (commands), babysit, and target (how a
command names one queued resource, and the TPU API calls they all share).
"""

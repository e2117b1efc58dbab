"""The name the queued resource's provider had in Pulumi state before infra/ had packages.

Pulumi keeps each dynamic resource's provider in the stack's state, pickled by module and class
name, and `pulumi destroy` and `refresh` unpickle the one in state, not the program's: a stack
whose queued resource was created before the move names this module until it is next updated.
Nothing in the project imports it (tests/infra/test_tpu_provider.py unpickles such a state).
"""

from infra.tpu_vm.provider import QueuedResourceProvider

__all__ = ["QueuedResourceProvider"]

"""The stack file and its rules: typed keys, the one loader, the shared checks, derived names and specs."""

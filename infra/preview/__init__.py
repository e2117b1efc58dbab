"""The checks `pulumi preview` runs against the cloud: dynamic resources that only check (or pin)."""

"""The cloud parts both orchestrations share: APIs, network, bucket, identity."""

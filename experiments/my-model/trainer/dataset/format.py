"""What `trainer.prepare` writes and `trainer.dataset.input_pipeline` reads: the format names,
file names and the error both raise. Standard library only, so that `python -m trainer.prepare` (and
`multislice data prepare`) starts without importing Grain and JAX."""

from __future__ import annotations

FORMAT = "trainer-tokens-v2"
FORMAT_V1 = "trainer-bytes-v1"  # byte tokens, no eval split; still read
FORMATS = (FORMAT, FORMAT_V1)
TOKEN_DTYPES = ("uint8", "uint16", "uint32")
METADATA_FILE = "metadata.json"
SHARD_SUFFIX = ".array_record"


class DataError(ValueError):
    """The data files or the data settings are unusable; the message names the path or value."""

"""The toolkit's gs:// access: one gcsfs filesystem, set up as the trainer's own
(template trainer/storage.py, which a fork carries without the toolkit)."""

from __future__ import annotations

import os
from typing import Any


def filesystem() -> Any:
    """A gcsfs filesystem; honours STORAGE_EMULATOR_HOST like every Google storage client."""
    # Our buckets are standard ones; otherwise gcsfs asks the Storage Control API about each
    # bucket and warns on every call when it cannot tell.
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    import gcsfs

    return gcsfs.GCSFileSystem()

"""`python -m trainer.prepare`: text files -> ArrayRecord shards of token records
(trainer/dataset/prepare.py)."""

import sys

from .dataset.prepare import main

if __name__ == "__main__":
    sys.exit(main())

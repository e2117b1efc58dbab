"""`python -m trainer.convert`: Hugging Face Llama checkpoints in and out
(trainer/hf/convert.py)."""

import sys

from .hf.convert import main

if __name__ == "__main__":
    sys.exit(main())

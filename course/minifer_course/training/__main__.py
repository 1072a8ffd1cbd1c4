"""``python -m minifer_course.training``: retrain the shipped tokenizer and models (see `train.main`)."""

import os

from .train import main

if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())

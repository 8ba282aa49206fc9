"""Serving benchmark: the same as ``mambaradix bench`` (all its flags), as a script.

python bench/bench_serving.py --model-path tiny:qwen3_next:small --compare-cache
python bench/bench_serving.py --base-url http://127.0.0.1:30000 --dataset-name multi-turn
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from mambaradix.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))

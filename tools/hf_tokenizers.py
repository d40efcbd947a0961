"""Build real Hugging Face tokenizer folders offline (the Qwen2/Qwen3 vocabulary, about 80 chat templates).

    python tools/hf_tokenizers.py [--out DIR] [--names qwen3 glm-4.6 ...]   # prints NAME<TAB>FOLDER a line

A thin CLI over :mod:`t1async.models.hf_tokenizers` (what it downloads, converts and writes; the tests
build their real tokenizer folders with it too).
"""

from __future__ import annotations

from t1async.models.hf_tokenizers import main

if __name__ == "__main__":
    raise SystemExit(main())

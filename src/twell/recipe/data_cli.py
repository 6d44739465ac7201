"""``twell data``: corpora for ``twell train``.

    twell data prepare SRC... --tokenizer T --out DIR

tokenizes the sources once, in parallel processes, into token shards on disk plus an index
(:mod:`twell.recipe.shards`); ``twell train --data DIR`` then streams windows from them.

    twell data tokenizer SRC... --vocab-size N --out DIR

learns a byte-level BPE tokenizer from the sources' training split (:mod:`twell.recipe.bpe`),
offline, and saves it as a Hugging Face fast tokenizer: ``--tokenizer DIR`` of the commands
above.
Only argparse is imported here: the work's modules load once the arguments are parsed.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["data_main"]

EXAMPLES = """\
examples:
  twell data prepare corpus/ more.jsonl --tokenizer HuggingFaceTB/SmolLM-135M --out data/smol
  twell data prepare stdlib --out data/stdlib-bytes          (byte tokens, the default)
  twell train --data data/smol --preset 0.5b
"""

TOKENIZER_EXAMPLES = """\
examples:
  twell data tokenizer corpus/ --vocab-size 16384 --out tok/corpus-16k
  twell data prepare corpus/ --tokenizer tok/corpus-16k --out data/corpus-16k
  twell train --data data/corpus-16k --preset small
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="twell data", description="Prepare corpora for twell train.")
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    q = sub.add_parser("prepare", help="tokenize sources once into token shards + an index",
                       description="Tokenize SRC... once into token shards (uint16 or uint32 by vocabulary size) and an "
                       "index, twell_corpus.json; documents go to validation by the same hash of their key as with raw "
                       "--data, so the split is the raw files' split.",
                       epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    q.add_argument("sources", nargs="+", metavar="SRC", help="'stdlib', files/folders/globs of .txt .md .py .rst "
                   ".jsonl .parquet, or hf:NAME[:CONFIG] (as twell train --data)")
    q.add_argument("--out", required=True, help="output folder (must not exist, or be empty)")
    q.add_argument("--tokenizer", default="bytes", help="'bytes' (default) or a Hugging Face tokenizer path or name")
    q.add_argument("--val-fraction", type=float, default=0.02, help="share of documents held out, by hash of their key (default 0.02)")
    q.add_argument("--text-field", default="text", help="JSONL field / Parquet column with the text (default text)")
    q.add_argument("--max-docs", type=int, help="read at most this many documents of an hf: dataset")
    q.add_argument("--workers", type=int, help="tokenizing processes (0: this one; default: 0 for byte tokens, "
                   "else the CPU count, at most 8)")
    q.add_argument("--shard-tokens", type=int, default=1 << 28, help="tokens per shard file (default 2^28)")
    q.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    t = sub.add_parser("tokenizer", help="learn a byte-level BPE tokenizer from the sources' training split",
                       description="Train a byte-level BPE tokenizer (the tokenizers library, GPT-2's byte-level "
                       "pre-tokenizer: every text encodes losslessly) on the training documents of SRC..., offline, "
                       "and save it as a Hugging Face fast tokenizer with <|endoftext|> as its end-of-text token. "
                       "Validation documents (the runs' split: same --val-fraction) are not read. The tokenizer "
                       "depends only on the documents: the same on every machine.",
                       epilog=TOKENIZER_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("sources", nargs="+", metavar="SRC", help="as twell data prepare's")
    t.add_argument("--out", required=True, help="output folder (must not exist, or be empty)")
    t.add_argument("--vocab-size", type=int, default=16384, help="ids in all, the 256 bytes and <|endoftext|> "
                   "included (default 16384)")
    t.add_argument("--max-mb", type=float, default=32.0, help="learn from at most this many million characters of "
                   "training documents, a sample keyed on their names (default 32: seconds; 0: all)")
    t.add_argument("--val-fraction", type=float, default=0.02, help="share of documents held out, by hash of their key, "
                   "as the runs hold them out (default 0.02)")
    t.add_argument("--text-field", default="text", help="JSONL field / Parquet column with the text (default text)")
    t.add_argument("--max-docs", type=int, help="read at most this many documents of an hf: dataset")
    t.add_argument("--min-frequency", type=int, default=2, help="merge only pairs seen this often (default 2)")
    return p


def data_main(argv=None) -> dict:
    """Entry point of ``twell data``; returns the index of the prepared corpus."""
    a = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    if a.max_docs is not None and a.max_docs < 1:
        raise SystemExit(f"twell data {a.action}: --max-docs must be >= 1, got {a.max_docs}")
    if a.action == "tokenizer":
        return _tokenizer(a)
    from .shards import prepare_corpus

    try:
        index = prepare_corpus(a.sources, a.tokenizer, a.out, a.val_fraction, a.text_field, a.max_docs, a.workers,
                               a.shard_tokens, progress=a.progress)
    except (ValueError, FileNotFoundError, FileExistsError, ImportError) as err:
        raise SystemExit(f"twell data prepare: {err}")
    tr, va = index["splits"]["train"], index["splits"]["validation"]
    seconds = index["seconds"]
    print(f"{a.out}: {index['documents']:,} documents, {index['tokens']:,} tokens ({index['dtype']}, tokenizer "
          f"{index['tokenizer']['name']}) in {seconds:.1f} s ({index['tokens'] / max(seconds, 1e-9):,.0f} tokens/s)\n"
          f"  train {tr['stop'] - tr['start']:,} tokens ({tr['documents']:,} documents), validation "
          f"{va['stop'] - va['start']:,} tokens ({va['documents']:,} documents), split by {tr['split_by']}; "
          f"{len({sh['file'] for split in (tr, va) for sh in split['shards']})} shard file(s)")
    return index


def _tokenizer(a) -> dict:
    """``twell data tokenizer``: train, save and report; returns what the folder's info file holds."""
    if a.max_mb < 0:
        raise SystemExit(f"twell data tokenizer: --max-mb must be >= 0 (0: every training document), got {a.max_mb:g}")
    from .bpe import INFO_NAME, train_bpe

    try:
        info = train_bpe(a.sources, a.out, a.vocab_size, int(a.max_mb * 1e6) or None, a.val_fraction, a.text_field,
                         a.max_docs, a.min_frequency)
    except (ValueError, FileNotFoundError, FileExistsError, ImportError) as err:
        raise SystemExit(f"twell data tokenizer: {err}")
    print(f"{a.out}: byte-level BPE of {info['vocab_size']:,} ids (end of text {info['eos_token']} = "
          f"{info['eos_id']}), learnt from {info['chars']:,} characters of {info['documents']:,} training documents "
          f"in {info['seconds']:.1f} s; {INFO_NAME} records how\n"
          f"  use it: twell data prepare SRC... --tokenizer {a.out} --out DIR, or twell train --tokenizer {a.out}")
    return info

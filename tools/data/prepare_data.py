"""Prepare challenge-format data: token shards (`fineweb_{train,val}_NNNNNN.bin`) + manifest.json.

Subcommands (run from the repo root; `python -m tools.data.prepare_data ...` works too):

  fineweb    Download a cached FineWeb export (shards + tokenizer) from a Hugging Face dataset repo,
             driven by the repo's manifest like the official data/cached_challenge_fineweb.py. The
             official repo willdepueoai/parameter-golf (the default) serves only sp1024; the sp4096
             and sp8192 exports of the same documents are in kevclark/parameter-golf. One command
             per variant (a --train-shards above what the repo has is refused, naming the count; 14
             shards of 100M tokens cover a 1-GPU preset's ~1.1B tokens in 600 s, 80 the 8xh100's):
               python tools/prepare_data.py fineweb --variant sp1024 --train-shards 14
               python tools/prepare_data.py fineweb --variant sp4096 --train-shards 14 --repo-id kevclark/parameter-golf
               python tools/prepare_data.py fineweb --variant sp8192 --train-shards 14 --repo-id kevclark/parameter-golf
             -> data/datasets/fineweb10B_<variant>/ (+ manifest.json in our format: source repo id,
                tokenizer sha256), data/tokenizers/fineweb_<vocab>_bpe.{model,vocab} and the repo's
                own manifest, fetched fresh on every run, in
                data/hub_manifests/<owner>/<name>/<remote root>/manifest.json. Needs the network.
  jsonl      Shard your own text with an existing SentencePiece model (offline):
               python tools/prepare_data.py jsonl --input docs.jsonl --tokenizer M.model \
                   --out data/datasets/mydocs_sp1024 --val-docs 50000
             Inputs: `.jsonl` (one `{"text": ...}` object per line; blank lines ignored) or `.txt`
             (documents are separated by one or more blank lines; the lines of a document keep
             their newlines); either may be gzipped (`.gz`).
  caseops    CaseOps data as the top records used it (offline): each document's capitalization written as
             operators, tokenized with the CaseOps sp8192 model, plus the val byte sidecar
             fineweb_val_bytes_*.bin (each val token's original UTF-8 bytes, what val_bpb divides by):
               python tools/prepare_data.py caseops --docs docs_selected.jsonl \
                   --tokenizer fineweb_8192_bpe_lossless_caps_caseops_v1_reserved.model \
                   --out data/datasets/fineweb10B_sp8192_caseops
             The val split is the canonical first 50,000 documents; a smaller --val-docs would train on
             val documents and is refused with their count (--canonical-val-docs 0 for your own text,
             which has no canonical split). Shards of 10,000,000 tokens, as the records' script.
  tokenizer  Train a SentencePiece BPE model with the official settings (offline):
               python tools/prepare_data.py tokenizer --input docs.jsonl --vocab-size 1024 \
                   --out data/tokenizers/mydocs_1024_bpe
  sample     Offline default for a fresh machine: ~380 documents of real English text that ships
             with Python (pydoc_data.topics), a 1024-vocab tokenizer trained on the train split
             and the shards, in one command (a few seconds):
               python tools/prepare_data.py sample --out data
             -> data/text/pydoc_sample.jsonl, data/tokenizers/pydoc_sample_1024_bpe.model,
                data/datasets/pydoc_sample_sp1024/. Deterministic for a given Python version (the
                help texts change between Python releases).

Shard format and document layout are the official ones: every document is [BOS] + sp.encode(text)
with no EOS, the first --val-docs documents form the val split and the rest train, shards hold
100,000,000 tokens (a document may continue in the next shard; val and train never share one).
Train documents whose hash equals a val document's hash are dropped, so the splits are disjoint;
doc hash = first 16 hex chars of sha256(UTF-8 text), one per line in doc_hashes_{val,train}.txt.
A dataset is written whole: into a new folder beside --out (or the dataset folder) that replaces it
only when every file is written, so a failure (a full disk, Ctrl-C) keeps the previous dataset as it
was and removes the temporary files; the files of that folder the tools do not write are kept.
"""

import argparse
import os
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # `python tools/prepare_data.py` puts tools/, not the repo, on sys.path
    sys.path.insert(0, str(REPO_ROOT))

from primitives.cli_errors import USER_ERRORS, ArgumentParser, one_line, report_user_error  # noqa: E402
from tools.data.data_caseops import CASEOPS_SHARD_TOKENS, prepare_caseops_dataset  # noqa: E402
from tools.data.data_fineweb import (  # noqa: E402
    DEFAULT_HF_REMOTE_ROOT,
    DEFAULT_HF_REPO_ID,
    LARGE_VOCAB_HF_REPO_ID,
    HubUnreachableError,
    download_fineweb,
)
from tools.data.data_sample import build_sample  # noqa: E402
from tools.data.data_shards import OFFICIAL_NUM_VAL_DOCS, prepare_jsonl_dataset  # noqa: E402
from tools.data.data_text import check_inputs, iter_documents  # noqa: E402
from tools.data.data_tokenizer import train_tokenizer  # noqa: E402
from shards.format import SHARD_TOKENS_PER_FILE  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="prepare_data.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("fineweb", help="download the official cached FineWeb shards (network)")
    p.add_argument("--variant", default="sp1024", help="sp<VOCAB_SIZE> or byte260 (default sp1024)")
    p.add_argument("--train-shards", type=int, default=80, help="train shards of 100M tokens (default 80, official)")
    p.add_argument("--out-root", default="data", help="writes OUT_ROOT/datasets/ and OUT_ROOT/tokenizers/ (default data)")
    p.add_argument("--repo-id", default=os.environ.get("MATCHED_FINEWEB_REPO_ID", DEFAULT_HF_REPO_ID),
                   help=f"Hugging Face dataset repo owner/name (default {DEFAULT_HF_REPO_ID}, env MATCHED_FINEWEB_REPO_ID): "
                        f"the default serves only sp1024; for sp4096 and sp8192 use --repo-id {LARGE_VOCAB_HF_REPO_ID}")
    p.add_argument("--remote-root", default=os.environ.get("MATCHED_FINEWEB_REMOTE_ROOT_PREFIX", DEFAULT_HF_REMOTE_ROOT))

    p = sub.add_parser("jsonl", help="shard .jsonl/.txt documents with an existing SentencePiece model")
    p.add_argument("--input", nargs="+", required=True, help=".jsonl ({\"text\": ...} per line) or .txt (blank-line separated)")
    p.add_argument("--tokenizer", required=True, help="SentencePiece .model")
    p.add_argument("--out", required=True, help="dataset dir to write")
    p.add_argument("--val-docs", type=int, required=True, help=f"first N documents = val (official {OFFICIAL_NUM_VAL_DOCS})")
    p.add_argument("--max-docs", type=int, default=None, help="read at most M documents in total")
    p.add_argument("--shard-tokens", type=int, default=SHARD_TOKENS_PER_FILE, help="tokens per shard (default 100,000,000)")

    p = sub.add_parser("caseops", help="CaseOps shards + val byte sidecar (the records since 18 April)")
    p.add_argument("--docs", "--input", nargs="+", required=True, dest="input",
                   help="documents: .jsonl ({\"text\": ...} per line, e.g. docs_selected.jsonl) or .txt, optionally .gz")
    p.add_argument("--tokenizer", "--sp", required=True, dest="tokenizer", help="the CaseOps SentencePiece .model")
    p.add_argument("--out", required=True, help="dataset dir to write")
    p.add_argument("--val-docs", type=int, default=OFFICIAL_NUM_VAL_DOCS,
                   help=f"first N documents = val (default {OFFICIAL_NUM_VAL_DOCS}, the canonical split)")
    p.add_argument("--canonical-val-docs", type=int, default=OFFICIAL_NUM_VAL_DOCS,
                   help=f"the stream's canonical val split: its first K documents (default {OFFICIAL_NUM_VAL_DOCS}; "
                        "0: your own text, no canonical split); --val-docs below it is refused")
    p.add_argument("--max-docs", type=int, default=None, help="read at most M documents in total")
    p.add_argument("--shard-tokens", type=int, default=CASEOPS_SHARD_TOKENS,
                   help=f"tokens per shard (default {CASEOPS_SHARD_TOKENS:,}, as the records' script)")

    p = sub.add_parser("tokenizer", help="train a SentencePiece BPE model with the official settings")
    p.add_argument("--input", nargs="+", required=True)
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--out", required=True, help="PREFIX: writes PREFIX.model and PREFIX.vocab")
    p.add_argument("--input-sentence-size", type=int, default=1_000_000, help="max documents sampled for training")
    p.add_argument("--max-docs", type=int, default=None, help="use only the first M documents")
    p.add_argument("--max-sentence-length", type=int, default=None,
                   help="bytes; longer documents are skipped (SentencePiece default 4192)")
    p.add_argument("--no-byte-fallback", action="store_true", help="like the published sp1024/2048/4096 models")
    p.add_argument("--verbose", action="store_true", help="show SentencePiece's training log")

    p = sub.add_parser("sample", help="offline: Python's help texts -> tokenizer + shards")
    p.add_argument("--out", default="data", help="root dir (default data): text/, tokenizers/, datasets/")
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--val-docs", type=int, default=None, help="default: 10%% of the documents")
    p.add_argument("--shard-tokens", type=int, default=SHARD_TOKENS_PER_FILE)
    return parser


def _print_paths(result: dict) -> None:
    print(f"DATA_PATH={result['data_path']}")
    print(f"TOKENIZER_PATH={result['tokenizer_path']}")
    print(f"VOCAB_SIZE={result['vocab_size']}")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    t0 = time.perf_counter()
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731  stdout keeps only the paths
    try:
        if args.command == "fineweb":
            _print_paths(download_fineweb(args.variant, args.train_shards, args.out_root, repo_id=args.repo_id,
                                          remote_root=args.remote_root, log=log))
        elif args.command == "jsonl":
            manifest = prepare_jsonl_dataset(args.input, args.tokenizer, args.out, num_val_docs=args.val_docs,
                                             max_docs=args.max_docs, shard_tokens=args.shard_tokens, log=log)
            _print_paths({"data_path": args.out, "tokenizer_path": args.tokenizer, "vocab_size": manifest["vocab_size"]})
        elif args.command == "caseops":
            manifest = prepare_caseops_dataset(args.input, args.tokenizer, args.out, num_val_docs=args.val_docs,
                                               canonical_val_docs=args.canonical_val_docs, max_docs=args.max_docs,
                                               shard_tokens=args.shard_tokens, log=log)
            _print_paths({"data_path": args.out, "tokenizer_path": args.tokenizer, "vocab_size": manifest["vocab_size"]})
        elif args.command == "tokenizer":
            paths = check_inputs(args.input)
            max_docs = args.max_docs

            def docs():
                for i, text in enumerate(iter_documents(paths)):
                    if max_docs is not None and i >= max_docs:
                        return
                    yield text

            print(train_tokenizer(docs, args.vocab_size, args.out, input_sentence_size=args.input_sentence_size,
                                  max_sentence_length=args.max_sentence_length, byte_fallback=not args.no_byte_fallback,
                                  verbose=args.verbose, log=log))
        elif args.command == "sample":
            result = build_sample(args.out, vocab_size=args.vocab_size, num_val_docs=args.val_docs,
                                  shard_tokens=args.shard_tokens, log=log)
            _print_paths(result)
            log(f"sample ready in {time.perf_counter() - t0:.1f}s; smoke run: DATA_PATH={result['data_path']} "
                f"TOKENIZER_PATH={result['tokenizer_path']} VOCAB_SIZE={result['vocab_size']} PRESET=smoke python train_gpt.py")
    except HubUnreachableError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
    except USER_ERRORS as exc:  # a bad input, an unwritable --out or a full disk: one line, exit 2
        return report_user_error(exc)
    except KeyboardInterrupt as exc:  # WriteInterrupted names what was being written and what was kept
        print(f"error: {one_line(exc) or 'interrupted; nothing was written'}", file=sys.stderr, flush=True)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

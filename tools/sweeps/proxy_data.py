"""The CPU proxy's data: web text from local files (--shared), two val splits, one train stream.

    python tools/sweeps/proxy_data.py [--shared ../shared] [--out data]

All documents of the shared web-text files are shuffled with a fixed seed; the first 80 are the
`tune` val split (every recipe decision was made on it), the next 80 the `holdout` val split (only
the final comparison is scored on it), the rest train, in the same order in both datasets, so the
two datasets have byte-identical train shards: a run trains identically on either and only the
scored documents differ. Writes data/datasets/proxy_{tune,holdout}_sp1024/ with the challenge's
sp1024 tokenizer.
"""

import argparse
import json
import random
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from tools.data.data_shards import prepare_jsonl_dataset  # noqa: E402

PROXY_SOURCES = ("fineweb_edu", "nemotron_cc", "fineweb_textfixer", "c4_olmo_fixtures")
PROXY_SHUFFLE_SEED = 20240513
PROXY_VAL_DOCS = 80


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shared", default=str(REPO_ROOT.parent / "shared"), help="folder with data/text and data/tokenizers")
    p.add_argument("--out", default="data", help="writes OUT/text/ and OUT/datasets/ (default data)")
    args = p.parse_args(argv)
    shared, out = Path(args.shared), Path(args.out)
    tokenizer = shared / "data/tokenizers/fineweb_1024_bpe.model"
    missing = [str(f) for f in [tokenizer] + [shared / f"data/text/{n}.jsonl" for n in PROXY_SOURCES] if not f.is_file()]
    if missing:
        print(f"error: --shared {shared}: missing {', '.join(missing)}", file=sys.stderr)
        return 2
    docs = []
    for name in PROXY_SOURCES:
        with open(shared / f"data/text/{name}.jsonl", encoding="utf-8") as f:
            docs += [json.loads(line)["text"] for line in f if line.strip()]
    random.Random(PROXY_SHUFFLE_SEED).shuffle(docs)
    splits = {"tune": docs[:PROXY_VAL_DOCS], "holdout": docs[PROXY_VAL_DOCS:2 * PROXY_VAL_DOCS]}
    train = docs[2 * PROXY_VAL_DOCS:]
    (out / "text").mkdir(parents=True, exist_ok=True)
    for split, val in splits.items():
        text = out / "text" / f"proxy_{split}.jsonl"
        text.write_text("".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in val + train), encoding="utf-8")
        prepare_jsonl_dataset([text], tokenizer, out / "datasets" / f"proxy_{split}_sp1024", num_val_docs=PROXY_VAL_DOCS)
        print(f"DATA_PATH={out / 'datasets' / f'proxy_{split}_sp1024'}  ({split}: {len(val)} val docs, {len(train)} train docs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

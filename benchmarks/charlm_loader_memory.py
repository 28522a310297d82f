"""Resident memory of character-LM training data: spacy-lean's memory-mapped loader
vs holding the ids in memory, on a ~100 MB generated text. Each approach runs in a
fresh subprocess; memory is the process's resident set (VmRSS, peak VmHWM, and the
anonymous part RssAnon, from /proc) above its level after imports. Prints JSON and
writes benchmarks/results/charlm_loader_memory.json.

    python benchmarks/charlm_loader_memory.py [--quick] [--mb 100] [--data-dir DIR]

Approaches (same dictionary, same text, batch 100 x bptt 250, one full epoch read and
converted to int64 torch tensors as a trainer does):
- lean: `encode_texts` (streaming, 1 MB chunks) into a uint8 file, `CharLMLoader`
  over the memmap. Expected: characters x 1 byte (file-backed pages, evictable) +
  O(batch).
- int64_tensor: the same ids held as one int64 tensor (as fastai's LM loader and
  Flair's trainer hold them), encoded with the same vectorised encoder.
- flair_textdataset: Flair's `TextDataset` recipe (read the file, split documents,
  a list of characters per document, a Python list comprehension of ids, an int64
  tensor), then Flair's `_batchify` (a contiguous [n / bs, bs] copy).
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from _procmem import proc_status, reset_peak  # benchmarks/_procmem.py
from _report import command_line, print_and_save  # noqa: E402  (benchmarks/_report.py)

APPROACHES = ["lean", "int64_tensor", "flair_textdataset"]
BATCH_SIZE = 100
BPTT = 250


def make_text(data_dir: Path, n_mb: float) -> Path:
    """A generated text of about `n_mb` MB (one sentence per line), written once."""
    path = data_dir / f"charlm_text_{n_mb:g}mb.txt"
    if path.exists():
        return path
    from spacy_lean.synthetic import generated_sentences

    data_dir.mkdir(parents=True, exist_ok=True)
    target = int(n_mb * 1_000_000)
    tmp = path.with_suffix(".tmp")
    written, seed = 0, 0
    with open(tmp, "w", encoding="utf8") as file_:
        while written < target:
            block = "\n".join(generated_sentences(20_000, seed=seed)) + "\n"
            file_.write(block)
            written += len(block.encode("utf8"))
            seed += 1
    tmp.replace(path)
    return path


def _iterate_lean(encoded, torch):
    from spacy_lean.charlm.loader import CharLMLoader

    loader = CharLMLoader(encoded, BATCH_SIZE, BPTT, seed=0)
    n = 0
    for x, y in loader:
        xt = torch.from_numpy(x).long()
        torch.from_numpy(y).long()
        n += xt.numel()
    return n


def child(approach: str, text_path: Path, dict_path: Path, work_dir: Path) -> dict:
    import numpy as np
    import torch

    from spacy_lean.charlm.loader import _CharEncoder, encode_texts, id_dtype, iter_text_chunks
    from spacy_lean.charlm.model import CharDictionary

    torch.set_num_threads(1)
    dictionary = CharDictionary(json.loads(dict_path.read_text(encoding="utf8")))
    base_rss = proc_status("VmRSS")
    base_anon = proc_status("RssAnon")
    peak_reset = reset_peak()
    start = time.perf_counter()
    if approach == "lean":
        encoded = encode_texts([text_path], dictionary, work_dir / "lean_ids", progress=False)
        t_data = time.perf_counter() - start
        n_chars = len(encoded)
        itemsize = encoded.ids.dtype.itemsize
        n_read = _iterate_lean(encoded, torch)
    elif approach == "int64_tensor":
        encoder = _CharEncoder(dictionary, id_dtype(len(dictionary)))
        parts = [
            torch.from_numpy(encoder(chunk).astype(np.int64))
            for chunk in iter_text_chunks([text_path])
        ]
        ids = torch.cat(parts)
        del parts
        t_data = time.perf_counter() - start
        n_chars, itemsize = len(ids), 8
        n_read = _iterate_tensor(ids)
    elif approach == "flair_textdataset":
        with open(text_path, encoding="utf-8") as file_:
            docs = (doc + "\n" for doc in file_.read().split("\n") if doc)
            lines = [list(doc) for doc in docs]
        ids = torch.tensor(
            [dictionary.get_idx(ch) for chars in lines for ch in chars], dtype=torch.long
        )
        del lines
        t_data = time.perf_counter() - start
        n_chars, itemsize = len(ids), 8
        n_batch = ids.size(0) // BATCH_SIZE
        data = ids.narrow(0, 0, n_batch * BATCH_SIZE).view(BATCH_SIZE, -1).t().contiguous()
        n_read = _iterate_tensor_batched(data)
    else:
        raise ValueError(approach)
    seconds = time.perf_counter() - start
    rss = proc_status("VmRSS") - base_rss
    anon = proc_status("RssAnon") - base_anon
    peak = proc_status("VmHWM") - base_rss
    return {
        "approach": approach,
        "n_chars": n_chars,
        "bytes_per_char_stored": itemsize,
        "chars_read": n_read,
        "rss_after_epoch_mb": rss / 1e6,
        "rss_anon_after_epoch_mb": anon / 1e6,
        "peak_rss_mb": peak / 1e6,
        "peak_is_since_start_of_measurement": peak_reset,
        "rss_bytes_per_char": rss / n_chars,
        "peak_bytes_per_char": peak / n_chars,
        "data_seconds": t_data,
        "total_seconds": seconds,
    }


def _iterate_tensor(ids):
    # Contiguous streams over the flat tensor, as a truncated-BPTT loader reads them.
    n_batch = ids.size(0) // BATCH_SIZE
    streams = ids.narrow(0, 0, n_batch * BATCH_SIZE).view(BATCH_SIZE, -1)
    n = 0
    for i in range(0, streams.size(1) - 1, BPTT):
        x = streams[:, i : i + BPTT].t().contiguous()
        streams[:, i + 1 : i + 1 + BPTT].t().contiguous()
        n += x.numel()
    return n


def _iterate_tensor_batched(data):
    n = 0
    for i in range(0, data.size(0) - 1, BPTT):
        seq = min(BPTT, len(data) - 1 - i)
        x = data[i : i + seq]
        data[i + 1 : i + 1 + seq].reshape(-1)
        n += x.numel()
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="10 MB instead of 100 MB")
    parser.add_argument("--mb", type=float, default=None, help="Size of the text in MB")
    parser.add_argument("--data-dir", type=Path, default=Path("/tmp/spacy_lean_bench"))
    parser.add_argument("--approaches", default=",".join(APPROACHES))
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        help="JSON file (default: benchmarks/results/charlm_loader_memory.json; --quick: none)",
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--text", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--dictionary", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.text, args.dictionary, args.data_dir)))
        return
    n_mb = args.mb if args.mb is not None else (10.0 if args.quick else 100.0)
    text_path = make_text(args.data_dir, n_mb)
    from spacy_lean.charlm.loader import build_dictionary

    dictionary = build_dictionary([text_path])
    dict_path = args.data_dir / f"charlm_dict_{n_mb:g}mb.json"
    dict_path.write_text(json.dumps(dictionary.idx2item), encoding="utf8")
    results = {}
    for approach in args.approaches.split(","):
        cmd = [
            sys.executable,
            __file__,
            "--child",
            approach,
            "--text",
            str(text_path),
            "--dictionary",
            str(dict_path),
            "--data-dir",
            str(args.data_dir),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
        results[approach] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"{approach}: {results[approach]}", file=sys.stderr)
    out = {
        "benchmark": "charlm_loader_memory",
        "text_mb": text_path.stat().st_size / 1e6,
        "vocab_size": len(dictionary),
        "batch_size": BATCH_SIZE,
        "bptt": BPTT,
        "command": command_line(__file__),
        "results": results,
    }
    if "lean" in results:
        lean = results["lean"]
        out["ratios_vs_lean"] = {
            name: {
                "peak_rss": r["peak_rss_mb"] / max(lean["peak_rss_mb"], 1e-9),
                "rss_after_epoch": r["rss_after_epoch_mb"] / max(lean["rss_after_epoch_mb"], 1e-9),
                "rss_anon_after_epoch": r["rss_anon_after_epoch_mb"]
                / max(lean["rss_anon_after_epoch_mb"], 1e-9),
            }
            for name, r in results.items()
            if name != "lean"
        }
    output = args.output
    if output is None and not args.quick:
        output = Path(__file__).parent / "results" / "charlm_loader_memory.json"
    print_and_save(out, output)


if __name__ == "__main__":
    main()

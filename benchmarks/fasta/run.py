#!/usr/bin/env python
"""Protein data at scale: index build, full read and random access on a large FASTA.gz.

    .venv/bin/python -m benchmarks.fasta.run                        # 1M records (~0.5 G residues), several minutes
    .venv/bin/python -m benchmarks.fasta.run --records 20000        # smoke run
    .venv/bin/python -m benchmarks.fasta.run --plain                # also the same file decompressed

Generates (once; kept under ``runs/``, which git ignores) a gzipped FASTA of random residues, lengths
uniform in [50, 1000], 60 residues per line. Each phase runs in a fresh Python process and reports its
records/s and its RSS growth: peak RSS (``ru_maxrss``) minus the RSS when the phase started (after the
imports), so the figure is the memory the reader itself needs, not the interpreter's.

Phases: ``build`` (validating pass + pyfastx index, ``IndexedFasta`` on a file with no index), ``reuse``
(opening it again: fingerprint check + memory-mapping), ``read`` (every record, in file order, through
``IndexedFasta.__iter__``), ``random`` (``--random`` records by number, in random order: what a
data-parallel replica does), ``plan`` (one epoch's ``PackedContextSampler`` for replica 0 of 8 at
context 65,536: length and every spec). Prints one line per phase (wall and CPU time of the process:
on a loaded machine the CPU rate is the one to compare) and a JSON summary (``<out>/results.json``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import resource
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

RESIDUES = b"ACDEFGHIKLMNPQRSTVWY"


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def generate(path: Path, records: int, seed: int) -> None:
    import numpy as np

    rng = np.random.default_rng(seed)
    table = np.frombuffer(RESIDUES, dtype=np.uint8)
    tmp = path.with_name(path.name + ".tmp")
    with gzip.open(tmp, "wb", compresslevel=6) as f:
        for start in range(0, records, 10_000):
            n = min(10_000, records - start)
            lengths = rng.integers(50, 1001, size=n)
            residues = table[rng.integers(0, len(RESIDUES), size=int(lengths.sum()))].tobytes()
            out, pos = [], 0
            for k, length in enumerate(lengths.tolist()):
                out.append(b">UR%09d random protein %d\n" % (start + k, length))
                seq = residues[pos:pos + length]
                pos += length
                out.extend(seq[i:i + 60] + b"\n" for i in range(0, length, 60))
            f.write(b"".join(out))
    os.replace(tmp, path)


def phase(name: str, path: Path, index_dir: Path, n_random: int, seed: int) -> dict:
    import numpy as np

    from lightning_sp.data import IndexedFasta, PackedContextSampler

    base_rss = rss_mb()
    t0, c0 = time.perf_counter(), time.process_time()
    if name in ("build", "reuse"):
        fasta = IndexedFasta(path, index_dir=index_dir)
        assert fasta.built_now == (name == "build"), f"{name}: built_now={fasta.built_now}"
        count = len(fasta)
    elif name == "read":
        fasta = IndexedFasta(path, index_dir=index_dir)
        t0, c0 = time.perf_counter(), time.process_time()
        count, residues = 0, 0
        for rec in fasta:
            count += 1
            residues += len(rec.sequence)
        assert residues == int(fasta.lengths.sum(dtype=np.int64)), "full read disagrees with the index"
    elif name == "random":
        fasta = IndexedFasta(path, index_dir=index_dir)
        order = np.random.default_rng(seed).choice(len(fasta), size=min(n_random, len(fasta)), replace=False)
        t0, c0 = time.perf_counter(), time.process_time()
        for i in order.tolist():
            assert len(fasta.record(i).sequence) == int(fasta.lengths[i])
        count = len(order)
    elif name == "plan":
        fasta = IndexedFasta(path, index_dir=index_dir)
        t0, c0 = time.perf_counter(), time.process_time()
        sampler = PackedContextSampler(fasta.lengths, context_len=65_536, num_replicas=8, rank=0, seed=seed)
        count = sum(len(spec.pieces) for spec in sampler)  # records placed in this replica's contexts
    else:
        raise ValueError(name)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"phase": name, "records": count, "seconds": round(seconds, 3), "records_per_s": round(count / seconds, 1),
            "cpu_seconds": round(cpu, 3), "records_per_cpu_s": round(count / max(cpu, 1e-9), 1),
            "rss_growth_mb": round(peak_rss_mb() - base_rss, 1), "base_rss_mb": round(base_rss, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--random", type=int, default=2_000, help="records fetched by number in the random phase")
    parser.add_argument("--out", default=str(ROOT / "runs" / "bench_fasta"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plain", action="store_true", help="also measure the decompressed file")
    parser.add_argument("--plain-only", action="store_true", help="measure only the decompressed file")
    parser.add_argument("--phase", help=argparse.SUPPRESS)
    parser.add_argument("--file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    out = Path(args.out)
    if args.phase:  # child process: one phase
        print(json.dumps(phase(args.phase, Path(args.file), out / "index", args.random, args.seed)))
        return
    out.mkdir(parents=True, exist_ok=True)
    gz = out / f"random_{args.records}.fa.gz"
    if not gz.is_file():
        t = time.perf_counter()
        generate(gz, args.records, args.seed)
        print(f"generated {gz} ({gz.stat().st_size / 2**20:.0f} MiB) in {time.perf_counter() - t:.0f} s", flush=True)
    files = [] if args.plain_only else [gz]
    if args.plain or args.plain_only:
        plain = out / f"random_{args.records}.fa"
        if not plain.is_file():
            with gzip.open(gz, "rb") as src, open(plain, "wb") as dst:
                while chunk := src.read(1 << 24):
                    dst.write(chunk)
        files.append(plain)
    results = []
    for f in files:
        for p in (out / "index").glob(f"{f.name}.lsp-index*"):
            p.unlink()  # the build phase starts from no index
        for name in ("build", "reuse", "read", "random", "plan"):
            cmd = [sys.executable, __file__, "--phase", name, "--file", str(f), "--out", str(out),
                   "--random", str(args.random), "--seed", str(args.seed)]
            res = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
            res["file"] = f.name
            results.append(res)
            print(f"{f.name:>24} {name:>6}: {res['records']:>9} records in {res['seconds']:8.2f} s wall = "
                  f"{res['records_per_s']:>9.0f} records/s; {res['cpu_seconds']:8.2f} s CPU = "
                  f"{res['records_per_cpu_s']:>9.0f} records/CPU-s; RSS growth {res['rss_growth_mb']:6.1f} MB", flush=True)
    summary = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.node(),
               "cpus": os.cpu_count(), "load": os.getloadavg(), "records": args.records,
               "gz_mib": round(gz.stat().st_size / 2**20, 1), "results": results}
    (out / ("results_plain.json" if args.plain_only else "results.json")).write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

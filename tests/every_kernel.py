"""Run the correctness tests under every ATen CPU kernel set this CPU supports, and write what the
float64 oracle measured to tests/ORACLE.md.

    python tests/every_kernel.py            # every capability, then the report
    python tests/every_kernel.py --quick    # test_oracle and the 2- and 4-rank engine cases only

Rounding differs between ATen's default, AVX2 and AVX-512 kernels (and so between Intel and AMD
machines of this project's kind); a bound that holds under one but not another is tuned to a
machine. Each run sets ATEN_CPU_CAPABILITY for the whole pytest process (and the ranks it
starts) and TIERTRAIN_ORACLE_LOG, so every oracle check appends its engine and noise distances.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
CORRECTNESS = ["test_oracle.py", "test_engine.py", "test_activation_checkpointing.py", "test_delayed_update.py",
               "test_engine_pp.py", "test_engine_tp.py", "test_stage3.py", "test_zero.py", "test_pipeline.py",
               "test_tensor_parallel.py", "test_tiling.py", "test_gpt.py", "test_comm.py", "test_checkpoint.py",
               "test_offload.py", "test_param_gather.py", "test_overlapped_step.py", "test_nvme_optimizer.py",
               "test_zoo.py", "test_frozen.py", "test_stage3_graphs.py", "test_client_optimizer.py",
               "test_pretrained.py"]
QUICK = ["test_oracle.py", *(f"test_engine.py::test_fp32_matches_single_process_reference[{stage}-{world}]"
                             for stage in range(4) for world in (2, 4))]


def supported_capabilities() -> list[str]:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    caps = ["default"]
    if " avx2" in flags:
        caps.append("avx2")
    if " avx512f" in flags and " avx512bw" in flags and " avx512vl" in flags and " avx512dq" in flags:
        caps.append("avx512")
    return caps


def cpu_model() -> str:
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def counts(summary: str) -> tuple[int, int]:
    """(passed, failed) from pytest's closing line."""
    words = summary.replace(",", " ").split()
    def count(word):
        return sum(int(words[i - 1]) for i, w in enumerate(words) if w == word and words[i - 1].isdigit())
    return count("passed"), count("failed") + count("error") + count("errors")


def run(capability: str | None, tests: list[str], log: Path) -> tuple[int, str]:
    env = dict(os.environ, TIERTRAIN_ORACLE_LOG=str(log))
    env.pop("ATEN_CPU_CAPABILITY", None)
    if capability is not None:
        env["ATEN_CPU_CAPABILITY"] = capability
    # (-m: the tests named here run whether or not the suite marks them slow)
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "slow or not slow",
            *[str(HERE / t) for t in tests]]
    proc = subprocess.run(args, env=env, capture_output=True, text=True, cwd=HERE.parent)
    summary = [line for line in proc.stdout.splitlines() if " passed" in line or " failed" in line]
    return proc.returncode, (summary[-1] if summary else proc.stdout[-2000:])


def table(rows: list[dict]) -> list[str]:
    families = collections.defaultdict(list)
    for r in rows:
        test = r["test"].split("::")
        families[(test[0].removeprefix("tests/"), test[1].split("[")[0] if len(test) > 1 else "", r["kind"])].append(r)
    out = ["| file | test | kind | checks | worst engine distance | fp32 reference noise (min-max) "
           "| worst engine/noise |", "|---|---|---|---|---|---|---|"]
    for (file, test, kind), rs in sorted(families.items()):
        ratios = [r["engine"] / r["noise"] for r in rs if r["noise"] > 0]
        out.append(f"| {file} | {test} | {kind} | {len(rs)} | {max(r['engine'] for r in rs):.2e} | "
                   f"{min(r['noise'] for r in rs):.1e} - {max(r['noise'] for r in rs):.1e} | "
                   f"{max(ratios) if ratios else float('nan'):.2f} |")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="the oracle's own tests and the 2- and 4-rank engine cases")
    parser.add_argument("--report", type=Path, default=HERE / "ORACLE.md", help="where to write the measurements")
    args = parser.parse_args()
    tests = QUICK if args.quick else CORRECTNESS
    caps = [None, *supported_capabilities()]
    sections, failed, passed_total, failed_total = [], False, 0, 0
    with tempfile.TemporaryDirectory() as tmp:
        for cap in caps:
            log = Path(tmp) / f"{cap or 'unset'}.jsonl"
            code, summary = run(cap, tests, log)
            failed |= code != 0
            passed, failed_tests = counts(summary)
            passed_total, failed_total = passed_total + passed, failed_total + failed_tests
            name = f"ATEN_CPU_CAPABILITY={cap}" if cap else "ATEN_CPU_CAPABILITY unset"
            print(f"{name}: {summary}", flush=True)
            rows = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
            kernels = sorted({r["capability"] for r in rows})
            sections += [f"## {name} (ATen ran its {', '.join(kernels) or '?'} kernels)", "",
                         f"pytest: `{summary}`", "", *table(rows), ""]
    if not args.quick:
        header = ["# The float64 oracle, measured", "",
                  "Written by `python tests/every_kernel.py` (the correctness tests under every ATen CPU "
                  "capability this CPU supports). Each row is one test family: the engine's (or split "
                  "operator's) largest distance to the float64 reference, the fp32 reference's own distance "
                  "(the noise), and their largest ratio. The bound is 2 x noise + 4 ulps "
                  "(tests/reference.py). The test_oracle.py rows include the deliberately broken runs "
                  "(its mutations), whose large ratios are the point.", "", f"CPU: {cpu_model()}; torch "
                  f"{__import__('torch').__version__}; {os.cpu_count()} cores.", ""]
        args.report.write_text("\n".join(header + sections))
        print(f"wrote {args.report}")
    print(f"every_kernel: {passed_total} passed, {failed_total} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""scripts/gpu-check's report: the JSON each of its steps wrote, gathered under the keys
of docs/bench/gpu-<device>.json. Written after every step, so that a run cut short by
its time limit still leaves what it had (a step that did not run leaves its keys null).

    python benchmarks/gpu_report.py WORK_DIR TARGET.json STATUS [TESTS_STATUS]
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

# TensorRT-LLM's published throughput on an H200 (TP 1, fp8, every request queued; its
# perf-overview page), output tokens/s, beside which ours are printed
TRTLLM_H200 = {"8b_fp8_1000_1000": 17744, "8b_fp8_500_2000": 20770, "70b_fp8_1000_1000": 2909}


def gather(work: Path, passed: bool, tests_passed: bool = True) -> dict:
    """passed: every step ran to its end; tests_passed: the tests' step did."""
    def read(name: str) -> dict:
        path = work / f"{name}.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def first(run: dict, key: str):
        values = run.get(key) or {}
        return next(iter(values.values()), None)

    bf16, fp8, big = read("llama-3-8b"), read("llama-3-8b-fp8"), read("llama-3-70b-fp8")
    parity, parity_fp8_kv, fp8_parity = read("parity"), read("parity_fp8_kv"), read("parity_fp8")
    hf = read("llama-3-8b-hf")
    ours = {key: first(read(f"trtllm-{key.replace('_fp8', '').replace('_', '-')}"),
                       "tokens_per_s") for key in TRTLLM_H200}
    suite = None
    if (work / "tests.xml").exists():
        root = ET.parse(work / "tests.xml").getroot()
        suite = root if root.tag == "testsuite" else root.find("testsuite")
    tests = ({k: int(suite.get(k)) for k in ("tests", "failures", "errors", "skipped")}
             if suite is not None else {})
    ratio = lambda a, b: ({c: a["tokens_per_s"][c] / b["tokens_per_s"][c]  # noqa: E731
                           for c in a.get("tokens_per_s", {}) if c in b.get("tokens_per_s", {})})
    return {
        "device": bf16.get("device"), "model": bf16.get("model"),
        "tokens_per_s": bf16.get("tokens_per_s"), "floor_fraction": bf16.get("floor_fraction"),
        "spec_fraction": bf16.get("spec_fraction"),
        "fp8": {"tokens_per_s": fp8.get("tokens_per_s"),
                "floor_fraction": fp8.get("floor_fraction"),
                "speedup": ratio(fp8, bf16), "rel_l2": fp8_parity.get("rel_l2"),
                "top1_agreement": fp8_parity.get("top1_agreement"),
                "bf16_rel_l2": parity.get("rel_l2"),
                "bf16_top1_agreement": parity.get("top1_agreement"),
                "perplexity": read("perplexity_fp8") or None},
        "llama_3_70b_fp8": {"tokens_per_s": big.get("tokens_per_s"),
                            "floor_fraction": big.get("floor_fraction"),
                            "max_streams_4k": big.get("max_streams_4k")},
        "workloads": bf16.get("workloads"),
        "trtllm_table": {"ours": ours, "theirs": TRTLLM_H200,
                         "ratio": {k: v / TRTLLM_H200[k] for k, v in ours.items() if v}},
        "hf": {"generate": hf.get("hf_tokens_per_s"),
               "static_compile": hf.get("hf_static_compile_tokens_per_s")},
        "parity": {**parity, "llama_3_8b": read("parity_8b") or None},
        "parity_fp8_kv_cache": parity_fp8_kv,
        "tests": {**tests, "passed": tests_passed and bool(tests) and not (
            tests.get("failures") or tests.get("errors"))},
        "passed": passed,
        "runs": {name.stem: json.loads(name.read_text()) for name in sorted(work.glob("*.json"))},
    }


def main(argv=None) -> int:
    args = argv or sys.argv[1:]
    work, target, status = args[:3]
    tests_status = args[3] if len(args) > 3 else status
    report = gather(Path(work), int(status) == 0, int(tests_status) == 0)
    Path(target).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=1))
    print("report:", target)
    return 0


if __name__ == "__main__":
    sys.exit(main())

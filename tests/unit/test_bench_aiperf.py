"""Part 8 reads aiperf's own exports: per-request latencies and TTFTs from
``profile_export.jsonl``, failures counted apart, the duration from the summary;
and it renders ratios per kind and concurrency."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import aiperf_compare
from bench.stats import Summary, summarize


def _export(run_dir: Path, records: list[dict[str, object]], seconds: float) -> None:
    out = run_dir / "mymodel-openai-completions-concurrency16"
    out.mkdir(parents=True)
    summary = {"benchmark_duration": {"unit": "sec", "avg": seconds}}
    (out / "profile_export_aiperf.json").write_text(json.dumps(summary))
    (out / "profile_export.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")


def _ok(latency_ms: float, ttft_ms: float | None = None) -> dict[str, object]:
    metrics: dict[str, object] = {"request_latency": {"value": latency_ms, "unit": "ms"}}
    if ttft_ms is not None:
        metrics["time_to_first_token"] = {"value": ttft_ms, "unit": "ms"}
    return {"metadata": {}, "metrics": metrics}


def test_a_cell_from_an_aiperf_export(tmp_path: Path) -> None:
    failed: dict[str, object] = {"metrics": {}, "error": {"type": "InvalidInferenceResultError"}}
    _export(tmp_path, [_ok(40.0, 10.0), _ok(60.0, 30.0), failed, _ok(50.0, 20.0)], 2.0)
    cell = aiperf_compare.cell_from_export("agrpc-tcp", 16, tmp_path)
    assert (cell.n, cell.errors, cell.seconds) == (3, 1, 2.0)
    assert cell.rps == 1.5
    assert cell.p50_ms == pytest.approx(50.0)
    assert cell.ttft_p50_ms == pytest.approx(20.0)


def test_rollouts_have_no_ttft(tmp_path: Path) -> None:
    _export(tmp_path, [_ok(40.0), _ok(60.0)], 1.0)
    cell = aiperf_compare.cell_from_export("ainproc", 64, tmp_path)
    assert cell.n == 2 and cell.ttfts_s == []


def test_render_shows_both_kinds_with_ratios(tmp_path: Path) -> None:
    summaries: dict[str, dict[str, dict[int, Summary]]] = {}
    for kind in aiperf_compare.KINDS:
        per: dict[str, dict[int, Summary]] = {}
        for name, seconds in ((aiperf_compare.ONE_PROCESS, 1.0), (aiperf_compare.BRIDGED, 1.25)):
            per[name] = {}
            for c in aiperf_compare.CONCURRENCY:
                run_dir = tmp_path / f"{kind}-{name}-{c}"
                ttft = 10.0 if kind == "stream" else None
                _export(run_dir, [_ok(40.0, ttft)] * 100, seconds)
                cell = aiperf_compare.cell_from_export(name, c, run_dir)
                cell.cpu_ms = (
                    {"worker": 1.5}
                    if name == aiperf_compare.ONE_PROCESS
                    else {
                        "bridge": 1.0,
                        "engine": 0.75,
                    }
                )
                per[name][c] = summarize([cell])
        summaries[kind] = per
    text = aiperf_compare.AiperfCompare("aiperf", summaries).render()
    assert text.count("**0.80**") == 4  # rps ratio, both kinds, both concurrencies
    assert text.count("**1.00**") == 2  # TTFT ratio, streamed only
    assert "1.00 + 0.75" in text and "1.50" in text


def test_no_aiperf_means_the_part_is_skipped(tmp_path: Path) -> None:
    assert aiperf_compare.find_aiperf(str(tmp_path / "missing" / "aiperf")) is None
    present = tmp_path / "aiperf"
    present.write_text("")
    assert aiperf_compare.find_aiperf(str(present)) == str(present)

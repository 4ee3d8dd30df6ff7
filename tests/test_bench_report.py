"""`fusion bench`'s report: speed ratios between systems are paired repeat by repeat."""

from types import SimpleNamespace

from fusion_compute.bench.run import _row, ratios, systems, table


def _runs(decode_s: list[float], prefill_s: list[float] | None = None) -> list[dict]:
    return [
        {
            "decode_s": d,
            "prefill_8_s": p,
            "ttft_s": 0.1,
            "collectives_per_token": 4.0,
            "bytes_per_token": 1.0,
            "peak_rss_mb": {"client": 1.0},
        }
        for d, p in zip(decode_s, prefill_s or [1.0] * len(decode_s), strict=True)
    ]


def test_decode_ratios_are_medians_of_per_repeat_ratios():
    # 8 decode tokens: fusion N = 2 ran at 10, 20, 30 tok/s, fusion N = 1 at 20, 10, 15 in the same repeats.
    f2 = _row(("fusion", 2, "mpi"), _runs([0.8, 0.4, 8 / 30], [1, 1, 4]), 2, [8], 8)
    f1 = _row(("fusion", 1, "mpi"), _runs([0.4, 0.8, 8 / 15]), 2, [8], 8)
    mt = _row(("megatron-tp", 2, "mpi"), _runs([0.4, 0.4, 0.4], [2, 0.5, 2]), 2, [8], 8)
    out, spread = ratios([f1, mt, f2], SimpleNamespace(n_layers=1), 0.0)
    # Per repeat 0.5, 2, 2: median 2 (the ratio of the medians would be 20 / 15).
    assert abs(out["fusion2_mpi_vs_fusion1_decode"] - 2.0) < 1e-9
    assert abs(spread["fusion2_mpi_vs_fusion1_decode"]["min"] - 0.5) < 1e-9
    assert abs(out["fusion2_vs_megatron2_mpi_decode"] - 1.0) < 1e-9  # 0.5, 1, 1.5
    assert abs(spread["fusion2_vs_megatron2_mpi_decode"]["max"] - 1.5) < 1e-9
    # Prefill (8 tokens): 8, 8, 2 against 4, 16, 4 tok/s: per repeat 2, 0.5, 0.5 (the medians' ratio: 2).
    assert abs(out["fusion2_vs_megatron2_mpi_prefill"] - 0.5) < 1e-9
    report = {
        "model": "m",
        "layers": 1,
        "cores": 2,
        "decode_tokens": 8,
        "tcp_rtt_us": 1.0,
        "prompts": [8],
        "results": [f1, mt, f2],
        "ratios": out,
        "ratio_spread": spread,
    }
    assert "| fusion2_mpi_vs_fusion1_decode | 2.000 (0.500..2.000) |" in table(report)


def test_each_system_runs_once():
    """--workers 1,2 names fusion N = 1 twice and a repeated engine names everything twice: each runs once
    (two entries would share one list of runs and break the pairing)."""
    order = systems([1, 2], ["mpi", "mpi"])
    assert len(order) == len(set(order)) == 5
    assert order[:2] == [("transformers", 1, "-"), ("fusion", 1, "mpi")]

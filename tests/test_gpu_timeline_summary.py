"""bench/gpu_timeline_summary.py on a hand-made timeline: gaps between collectives and what
overlapped each one, against numbers worked out by hand."""

import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "bench"))

import gpu_timeline_summary as gts  # noqa: E402

BCAST = "ncclDevKernel_Broadcast_RING_LL(ncclDevKernelArgs)"


def test_gaps_overlaps_and_rates(tmp_path, capsys):
    ops = [  # name, device, stream, start us, duration us
        [BCAST, 0, 34, 0.0, 100.0],
        ["Memcpy PtoP (Device -> Device)", None, 154, 50.0, 80.0],  # 50 us inside broadcast 0
        ["Memcpy DtoD (Device -> Device)", 0, 7, 100.0, 20.0],  # wholly in the gap: overlaps none
        [BCAST, 0, 34, 120.0, 200.0],  # gap 20 us; the PtoP copy runs 10 us into it
        ["void some_kernel", 0, 7, 300.0, 40.0],  # 20 us inside broadcast 1
        [BCAST, 0, 34, 320.0, 50.0],  # gap 0
    ]
    out = gts.summarize(ops, "sender", bucket_bytes=[10_000_000, 40_000_000, 5_000_000])
    rows = out["rows"]
    assert [r["gap"] for r in rows] == [None, 20.0, 0.0]
    assert rows[0]["busy"] == {"copy PtoP": 50.0}
    assert rows[1]["busy"] == {"kernel": 20.0, "copy PtoP": 10.0}
    assert rows[2]["busy"] == {"kernel": 20.0}
    text = capsys.readouterr().out
    assert "100.0 GB/s" in text and "200.0 GB/s" in text  # 10 MB / 100 us, 40 MB / 200 us
    assert "span 370 us, in collectives 350 us, gaps 20 us" in text


def test_main_reads_the_bench_output_folder(tmp_path, capsys):
    tl = {"t0_us": 0, "gpu": [[BCAST, 0, 34, 0.0, 10.0], [BCAST, 0, 34, 15.0, 10.0]],
          "api": [["cudaStreamSynchronize", 1.0, 500.0], ["cudaLaunchKernel", 2.0, 5.0]]}
    (tmp_path / "nccl_gpu_timeline.json").write_text(json.dumps(tl))
    (tmp_path / "nccl_slots2_gpu_timeline.json").write_text(json.dumps(tl))
    (tmp_path / "nccl.json").write_text(json.dumps({"plan": {"bucket_bytes": [1000, 2000]}}))
    gts.main([str(tmp_path)])
    text = capsys.readouterr().out
    assert "== trainer rank 0:" in text and "== trainer rank 0, slots2:" in text
    assert "cudaStreamSynchronize at 1 for 500" in text and "cudaLaunchKernel" not in text
    assert "gap     5.0" in text

"""scripts/check_tp.py: its verdict on made-up answers (equal, parted at a near tie, parted
where the N = 1 run was sure, parted on a token outside its top 2), and the whole check on the
CPU: the tiny checkpoint served with --tensor-parallel-size 1 and 2 (gloo) over real HTTP."""

from __future__ import annotations

import json

from scripts import check_tp


def answer(tokens: list[int], logprobs: list[float], second: list[tuple[int, float]]) -> dict:
    return {"tokens": tokens, "logprobs": logprobs,
            "top2": [{t: lp, s: slp} for t, lp, (s, slp) in zip(tokens, logprobs, second)]}


def test_requests_part_only_at_near_ties():
    ref = [answer([1, 2, 3], [-0.1, -0.7, -0.2], [(9, -3.0), (4, -0.705), (9, -2.0)]),
           answer([1, 2, 3], [-0.1, -0.2, -0.2], [(9, -3.0), (4, -2.5), (9, -2.0)]),
           answer([5, 6], [-0.3, -0.4], [(9, -3.0), (9, -3.0)])]
    got = [answer([1, 4, 7], [-0.1001, -0.703, -0.5], [(9, -3.0), (2, -0.71), (9, -2.0)]),
           answer([1, 4, 7], [-0.1, -0.21, -0.5], [(9, -3.0), (2, -2.5), (9, -2.0)]),
           answer([5, 8], [-0.3, -0.4], [(9, -3.0), (9, -3.0)])]
    report = check_tp.compare(ref, ref, tie_gap=1e-2)
    assert report["equal"] == 3 and report["parted"] == []
    report = check_tp.compare(ref, got, tie_gap=1e-2)
    assert report["equal"] == 0
    near, sure, outside = report["parted"]
    assert (near["step"], near["near_tie"]) == (1, True) and abs(near["gap"] - 0.005) < 1e-9
    assert (sure["step"], sure["near_tie"]) == (1, False) and abs(sure["gap"] - 2.3) < 1e-9
    assert (outside["step"], outside["gap"], outside["near_tie"]) == (1, None, False)
    assert abs(report["max_logprob_diff_shared"] - 1e-4) < 1e-9  # step 0 only, where all agree


def test_tensor_parallel_2_serves_the_tokens_of_1(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    code = check_tp.main(["--tiny", "--sizes", "2", "--requests", "8", "--port", "30571",
                          "--work-dir", str(tmp_path / "work")])
    report = json.loads((tmp_path / "out" / "check_tp.json").read_text())["tp2"]
    assert code == 0 and report["ok"]
    assert report["equal"] == report["requests"] == 8
    assert report["max_logprob_diff_shared"] < 1e-4  # float32: summation order only

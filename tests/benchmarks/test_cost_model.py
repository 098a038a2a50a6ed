"""The weak-scaling cost model: shape of its predictions, calibration, the report."""
import copy
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from forge_dist import config as cfg_mod  # noqa: E402
from scaling_benchmarks import cost_model as cm  # noqa: E402

P_ALL = [1, 2, 3, 4, 8, 9, 16, 17, 32, 64, 96, 128]
MIB = 2 ** 20


def params(**over):
    p = copy.deepcopy(cm.DEFAULTS)
    for key, value in over.items():
        table, _, name = key.partition("__")
        if name:
            p[table][name] = value
        else:
            p[table] = value
    return p


@pytest.mark.parametrize("strategy", cm.STRATEGIES)
@pytest.mark.parametrize("op", cm.OPS)
@pytest.mark.parametrize("pass_", cm.PASSES)
def test_monotone_in_P(strategy, op, pass_):
    m = cm.Model(params())
    times = [m.predict(op, strategy, pass_, P)["ms"] for P in P_ALL]
    assert all(b >= a for a, b in zip(times, times[1:])), times
    assert times[-1] > times[1]  # 128 GPUs cost something over 2


def test_model_primitives_reproduce_the_documented_h200_measurements():
    """The documented 8 MiB transfers (configs/cost_model.toml: NCCL send/recv 33 us,
    all_gather at P=2 56 us, NVSHMEM put 29.5 us) come back out of the model's own chain and
    all-gather code once host launches and combines are priced at zero: a change in how the
    model prices a hop (units, a latency counted twice, the wrong link) fails this."""
    free = params(host={**cm.DEFAULTS["host"], "launch_us": 0.0},
                  hardware={**cm.DEFAULTS["hardware"], "kernel_launch_us": 0.0,
                            "hbm_GBps": 1e15, "fp32_tflops": 1e15},
                  forge={**cm.DEFAULTS["forge"], "tile_kib": 8 * 1024.0})
    m = cm.Model(free)
    assert m.sizes("simple_gla")[0] == 8 * MIB  # the default workload's state is 8 MiB
    assert m.chain_us("serial", "simple_gla", 2) == pytest.approx(33.0, abs=0.1)
    assert m.allgather_us(2, 8 * MIB) == pytest.approx(56.0, abs=0.1)
    assert m.chain_us("forge", "linear_attn", 2) == pytest.approx(29.5, abs=0.1)
    # FLA's measured GDN forward at B=1, 32K tokens (1.94 ms) lies between the 16K and 64K
    # anchors: the model's log-log interpolation must land on it, and FLA CP's 2-GPU time
    # on its measured 6.97 ms
    m1 = cm.Model(params(workload={**cm.DEFAULTS["workload"], "B": 1}))
    assert m1.ideal_ms("gated_delta_rule", "fwd") == pytest.approx(1.94, rel=0.02)
    assert m1.predict("gated_delta_rule", "fla_cp", "fwd", 2)["ms"] == pytest.approx(6.97,
                                                                                     rel=0.02)


def test_chains_match_hand_computed_values():
    """Non-default parameters and a 64 KiB state, the expected times worked out by hand."""
    m = cm.Model(params(workload={**cm.DEFAULTS["workload"], "B": 1, "H": 2, "K": 64,
                                  "V": 128},
                        nvlink={**cm.DEFAULTS["nvlink"], "p2p_latency_us": 4.0,
                                "p2p_GBps": 100.0}))
    assert m.sizes("simple_gla") == (65536.0, 8.0)
    # combine: 5 us launch + (3 * 65536 + 8) B at 4000 GB/s = 5.049154 us
    assert m.combine_us("simple_gla") == pytest.approx(5.049154, rel=1e-6)
    # serial, 3 ranks: 2 hops of (6 launch + 4 + 0.65536) us, and 2 combines, and the
    # second hop's skew (43.3 us)
    assert m.chain_us("serial", "simple_gla", 3) == pytest.approx(31.409028 + 43.3, rel=1e-6)
    # pipelined, 4 tiles: a stage is 15 + 4 + 0.16384 + 5.049154 / 4 us; 2 hops + 3 stages,
    # and the skew
    assert m.chain_us("pipelined", "simple_gla", 3) == pytest.approx(102.1306425 + 43.3,
                                                                       rel=1e-6)
    # lasp2 forward: one all-gather of state and transition, 2 x (10 + 65544 B / 182.4 GB/s)
    # after the 6 us launch, and 2 combines
    assert m.chain_us("lasp2", "simple_gla", 3) == pytest.approx(
        6 + 2 * (10 + 65544 / 182.4e3) + 2 * 5.049154, rel=1e-6)


def test_serial_grows_linearly():
    one_node = params(gpus_per_node=10 ** 6)  # every hop NVLink: constant increments
    m = cm.Model(one_node)
    chain = [m.chain_us("serial", "simple_gla", P) for P in range(2, 40)]
    steps = [b - a for a, b in zip(chain, chain[1:])]
    assert steps[0] > 0 and all(s == pytest.approx(steps[0]) for s in steps)
    # across nodes each 8th hop is an InfiniBand hop, and costs more
    m8 = cm.Model(params())
    c = [m8.chain_us("serial", "simple_gla", P) for P in range(1, 18)]
    inc = [b - a for a, b in zip(c[1:], c[2:])]  # hop P-1 -> P for P = 2..17
    ib = {8, 16}
    assert all(inc[P - 2] > inc[0] for P in ib) and inc[1] == pytest.approx(inc[0])


def test_forge_flat_in_its_hidden_regime_and_not_outside():
    p = params(forge__overlap_frac=0.5)
    m = cm.Model(p)
    for op in cm.OPS:
        local = m.ideal_local_ms(op, "fwd")
        hidden = [P for P in P_ALL[1:] if m.chain_us("forge", op, P) / 1e3 <= 0.5 * local]
        assert hidden, op
        flat = {round(m.predict(op, "forge", "fwd", P)["ms"], 12) for P in hidden}
        assert len(flat) == 1, (op, flat)
    # with nothing hidden the same chain is exposed and forge grows with P
    m0 = cm.Model(params(forge__overlap_frac=0.0))
    g = [m0.predict("simple_gla", "forge", "fwd", P)["ms"] for P in (2, 16, 128)]
    assert g[0] < g[1] < g[2]
    # a slow op hides even 128 GPUs of chain; LASP-2 does not get that benefit
    big = cm.Model(params(forge__overlap_frac=0.5, ideal_ms={"gla": {"fwd": 50.0}},
                          ideal_local_ms={"gla": {"fwd": 45.0}}))
    assert big.predict("gla", "forge", "fwd", 128)["ms"] == pytest.approx(
        big.predict("gla", "forge", "fwd", 2)["ms"])
    assert big.predict("gla", "lasp2", "fwd", 128)["ms"] > \
        big.predict("gla", "lasp2", "fwd", 2)["ms"] * 1.01


def test_lasp2_outgrows_forge_and_needs_P_states():
    m = cm.Model(params())
    op = "gated_delta_rule"
    grow = {s: m.predict(op, s, "fwd", 128)["ms"] - m.predict(op, s, "fwd", 2)["ms"]
            for s in ("lasp2", "forge", "serial")}
    assert grow["lasp2"] > 5 * grow["forge"]
    mem = [m.predict(op, "lasp2", "fwd", P)["peak_mib_extra"] for P in (2, 128)]
    assert mem[1] == pytest.approx(mem[0] * (128 * 16 + 8) / (2 * 16 + 8))


def _synthetic(truth, sizes_ops=cm.OPS):
    """Results files made by the model itself: state-pass rows and weak-scaling rows."""
    m = cm.Model(truth)
    rows = []
    for op in sizes_ops:
        S, Mb = m.sizes(op)
        for s in ("serial", "pipelined", "lasp2", "forge"):
            us = m.chain_us(s, op, 2, "fwd")
            rows.append({"op": op, "T": 2, "pass": "fwd", "impl": "forge_dist", "strategy": s,
                         "world_size": 2, "measure": "state_pass", "ms": us / 1e3, "us": us,
                         "state_mib": S / MIB, "transition_mib": Mb / MIB})
    for op in sizes_ops:
        for ps in cm.PASSES:
            ideal, local = truth["ideal_ms"][op][ps], truth["ideal_local_ms"][op][ps]
            rows.append({"op": op, "T": 1, "pass": ps, "impl": "forge_dist", "strategy": "ideal",
                         "world_size": 1, "measure": "ideal", "ms": ideal,
                         "breakdown": {"local_ms": local, "comm_ms": 0.0,
                                       "merge_ms": ideal - local}})
            for s in ("serial", "lasp2", "forge"):
                pred = m.predict(op, s, ps, 2)
                chk = truth["compute"]["overhead_ms"]
                r0 = {"rank": 0, "ms": pred["ms"], "check_ms": chk,
                      "local_ms": local + truth["m_extra_ms"][op][ps] + chk}
                r1 = {"rank": 1, "ms": pred["ms"], "check_ms": chk, "local_ms": local + chk}
                rows.append({"op": op, "T": 2, "pass": ps, "impl": "forge_dist",
                             "strategy": s, "world_size": 2, "measure": "op",
                             "ms": pred["ms"], "breakdown": pred["breakdown"],
                             "per_rank": [r0, r1]})
    cfg = dict(truth["workload"])
    return [{"benchmark": "weak_scaling", "device": "synthetic", "config": cfg, "rows": rows}]


def _truth():
    t = params()
    t["nvlink"].update(p2p_latency_us=6.5, p2p_GBps=250.0, coll_latency_us=12.0,
                       coll_GBps=150.0, dev_latency_us=3.0, dev_GBps=280.0)
    t["host"]["tile_host_us"] = 22.0
    t["forge"]["overlap_frac"] = 0.004  # hides part of the 2-GPU chain: identifiable
    t["compute"]["overhead_ms"] = 0.05
    t["workload"]["B"] = 2  # state sizes differ per op: 4 MiB, 32 KiB (hgrn)
    for op in cm.OPS:
        t["ideal_ms"][op] = {"fwd": 2.0 + len(op) / 10, "fwdbwd": 7.0 + len(op) / 10}
        t["ideal_local_ms"][op] = {"fwd": 1.5 + len(op) / 10, "fwdbwd": 6.0 + len(op) / 10}
        t["m_extra_ms"][op] = {"fwd": 0.1 * len(op) / 5, "fwdbwd": 0.3 * len(op) / 5}
    return t


def test_calibration_recovers_parameters_from_synthetic_data():
    truth = _truth()
    start = params()  # defaults: every fitted value starts wrong
    fitted_p, fitted = cm.calibrate(start, _synthetic(truth))
    for key in ("p2p_latency_us", "p2p_GBps", "coll_latency_us", "coll_GBps",
                "dev_latency_us", "dev_GBps"):
        assert fitted_p["nvlink"][key] == pytest.approx(truth["nvlink"][key], rel=1e-6), key
    assert fitted_p["host"]["tile_host_us"] == pytest.approx(22.0, rel=1e-6)
    assert fitted_p["compute"]["overhead_ms"] == pytest.approx(0.05)
    assert fitted_p["forge"]["overlap_frac"] == pytest.approx(0.004, rel=1e-6)
    for op in cm.OPS:
        for ps in cm.PASSES:
            assert fitted_p["m_extra_ms"][op][ps] == pytest.approx(truth["m_extra_ms"][op][ps])
            assert fitted_p["ideal_ms"][op][ps] == pytest.approx(truth["ideal_ms"][op][ps])
    assert fitted_p["workload"]["B"] == 2
    assert "nvlink.p2p" in fitted and "least squares" in fitted["nvlink.p2p"]
    # and then every synthetic point is predicted exactly
    doc = cm.report(fitted_p, _synthetic(truth), fitted, start)
    assert max(abs(v["rel_err"]) for v in doc["validation"]) < 1e-6


def test_calibration_recovers_the_cost_of_further_hops_and_rounds():
    """forge and scan rows at 2 ranks in one file and at 4 in another, from a machine whose
    shard is 0.05 ms slower: the skews of a further hop and round come back, each file's
    rows taken over its own shard."""
    truth = _truth()
    truth["forge"].update(hop_skew_us=40.0, round_skew_us=90.0)
    m = cm.Model(truth)
    files = []
    for P, shift in ((2, 0.0), (4, 0.05)):
        rows = []
        for op in ("simple_gla", "gated_delta_rule"):
            for ps in cm.PASSES:
                ideal = truth["ideal_ms"][op][ps] + shift
                rows.append({"op": op, "pass": ps, "impl": "forge_dist", "strategy": "ideal",
                             "world_size": 1, "measure": "ideal", "ms": ideal})
                for s in ("forge", "scan"):
                    rows.append({"op": op, "pass": ps, "impl": "forge_dist", "strategy": s,
                                 "world_size": P, "measure": "op",
                                 "ms": m.predict(op, s, ps, P)["ms"] + shift})
        files.append({"benchmark": "weak_scaling", "device": "synthetic",
                      "config": dict(truth["workload"]), "rows": rows})
    start = copy.deepcopy(truth)  # the links as the truth has them: the skew is the rest
    start["forge"].update(hop_skew_us=0.0, round_skew_us=0.0)
    fitted_p, fitted = cm.calibrate(start, files)
    assert fitted_p["forge"]["hop_skew_us"] == pytest.approx(40.0, rel=1e-6)
    assert fitted_p["forge"]["round_skew_us"] == pytest.approx(90.0, rel=1e-6)
    assert "each over its file's shard" in fitted["forge.hop_skew_us"]
    # the first hop carries no skew: 2 ranks predict the same with or without it
    bare = cm.Model(params(forge__hop_skew_us=0.0, forge__round_skew_us=0.0))
    skewed = cm.Model(params(forge__hop_skew_us=40.0, forge__round_skew_us=90.0))
    for s in ("forge", "scan"):
        assert skewed.chain_us(s, "simple_gla", 2) == bare.chain_us(s, "simple_gla", 2)
    for s in ("forge", "serial", "pipelined"):  # every chain's hop pays it
        assert skewed.chain_us(s, "simple_gla", 5) == pytest.approx(
            bare.chain_us(s, "simple_gla", 5) + 3 * 40.0)
    assert skewed.chain_us("scan", "simple_gla", 8) == pytest.approx(
        bare.chain_us("scan", "simple_gla", 8) + 2 * 90.0)


def test_fully_hidden_chain_gives_the_smallest_consistent_overlap():
    truth = _truth()
    truth["forge"]["overlap_frac"] = 0.5  # the 2-GPU chain disappears entirely
    fitted_p, _ = cm.calibrate(params(), _synthetic(truth))
    h = fitted_p["forge"]["overlap_frac"]
    assert 0 < h < 0.5  # a lower bound: exactly hiding the chain, conservative beyond P=2
    m, t = cm.Model(fitted_p), cm.Model(truth)
    for op in cm.OPS:
        assert m.predict(op, "forge", "fwd", 2)["ms"] == pytest.approx(
            t.predict(op, "forge", "fwd", 2)["ms"], rel=0.01)


def test_fit_affine_paths():
    a, bw, how = cm.fit_affine([(8 * MIB, 33.0)], 8.0, 100.0)
    assert a == 8.0 and bw == pytest.approx(335.5, rel=1e-3) and "bandwidth" in how
    a, bw, how = cm.fit_affine([(MIB, 3.0)], 8.0, 1000.0)  # faster than the default latency
    assert bw == 1000.0 and a == pytest.approx(3.0 - MIB / 1e6) and "latency" in how
    assert cm.fit_affine([], 1.0, 2.0) == (1.0, 2.0, "default")


def test_paper_check_is_consistent():
    pc = cm.paper_check(params())
    assert pc["measured"]["growth"] == pytest.approx(345 / 49.2)
    assert pc["fwd"]["predicted_growth"] > 1.0
    assert pc["fwdbwd"]["predicted_growth"] > pc["fwd"]["predicted_growth"]
    # the reported IB bandwidth that would match the paper does match it
    q = params()
    q["ib"]["coll_GBps"] = pc["fwd"]["ib_coll_GBps_to_match"]
    assert cm.paper_check(q)["fwd"]["predicted_growth"] == pytest.approx(
        pc["measured"]["growth"], rel=1e-3)
    assert pc["forge_fwd_growth_unhidden"] < pc["fwd"]["predicted_growth"]


def test_cli_writes_json_and_png(tmp_path):
    data = tmp_path / "weak_scaling_synthetic_ws2.json"
    res = _synthetic(_truth())[0]
    res.update(world_size=2, date="2026-01-01")
    data.write_text(json.dumps(res))
    out = tmp_path / "out"
    assert cm.main(["--config", str(REPO / "configs" / "cost_model.toml"), "--set",
                    "P=[1, 2, 8, 128]", "--calibrate", str(data), "--out", str(out)]) == 0
    files = list(out.glob("cost_model_*.json"))
    assert len(files) == 1 and files[0].with_suffix(".png").stat().st_size > 10_000
    doc = json.loads(files[0].read_text())
    assert doc["benchmark"] == "cost_model" and doc["device"] == "synthetic"
    assert {r["world_size"] for r in doc["rows"]} == {1, 2, 8, 128}
    assert set(doc["forge_128_vs_2"]) == set(cm.OPS)
    assert doc["validation"] and doc["paper_check"]["verdict"]
    for r in doc["rows"]:
        assert r["ms"] > 0 and set(r["breakdown"]) == {"local_ms", "comm_ms", "merge_ms"}


def test_config_file_matches_defaults():
    loaded = cfg_mod.load(cm.DEFAULTS, str(REPO / "configs" / "cost_model.toml"))
    for table in ("nvlink", "ib", "host", "hardware", "forge", "workload", "paper_check"):
        assert loaded[table] == cm.DEFAULTS[table], table
    with pytest.raises(cfg_mod.ConfigError):
        cfg_mod.load(cm.DEFAULTS, None, ["nvlink.nope=1"])


def test_log_depth_passes_count_their_rounds():
    m = cm.Model(params())
    nv, ib = m.p["nvlink"], m.p["ib"]
    assert m.rounds("scan", 8) == [nv] * 3  # one node: NVLink only
    assert m.rounds("scan", 1024) == [ib] * 10  # past a node every round has a cross pair
    assert m.rounds("hier", 8) == [nv] * 3
    # inside the node, across 128 nodes' totals, then the node's state to its ranks
    assert m.rounds("hier", 1024) == [nv] * 3 + [ib] * 7 + [nv]
    assert m.rounds("scan", 2) == [nv] and m.rounds("scan", 3) == [nv] * 2


def test_log_depth_passes_grow_with_log_P_and_the_chain_with_P():
    m = cm.Model(params())
    op = "simple_gla"
    scan = [m.chain_us("scan", op, 2 ** k) for k in range(1, 4)]  # inside a node
    steps = [b - a for a, b in zip(scan, scan[1:])]
    assert steps[0] == pytest.approx(steps[1])  # one more NVLink round per doubling
    big = {s: m.chain_us(s, op, 1024) for s in ("forge", "scan", "hier")}
    assert max(big["hier"], big["scan"]) < big["forge"] / 10  # 10 or 11 rounds, 1023 hops
    # each round waits (round_skew_us): scan's 10 rounds beat hier's 11, though hier's
    # cross InfiniBand only 7 times; with puts alone, hier's cheaper rounds win
    assert big["scan"] < big["hier"]
    puts = cm.Model(params(forge__round_skew_us=0.0, forge__hop_skew_us=0.0))
    assert puts.chain_us("hier", op, 1024) < puts.chain_us("scan", op, 1024)
    assert m.chain_us("hier", op, 8) == m.chain_us("scan", op, 8)


def test_auto_picks_the_fastest_gpu_initiated_strategy():
    m = cm.Model(params(workload={"B": 1, "H": 32, "K": 128, "V": 128, "D_hgrn": 0,
                                  "tokens_per_gpu": 16384}))
    for P in (2, 8, 64, 1024):
        chosen, pred = m.auto("simple_gla", "fwd", P)
        times = {s: m.predict("simple_gla", s, "fwd", P)["ms"] for s in cm.GPU_INITIATED}
        assert pred["ms"] == min(times.values()) and times[chosen] == pred["ms"]
    assert m.auto("simple_gla", "fwd", 2)[0] == "forge"  # one hop: the chain, no M to send
    assert m.auto("simple_gla", "fwd", 1024)[0] in ("scan", "hier")


def test_report_has_auto_rows_and_flatness(tmp_path):
    p = params(P=[1, 2, 16, 1024], ops=["gla"], strategies=["forge", "scan", "hier"])
    doc = cm.report(p, [], {})
    auto = [r for r in doc["rows"] if r["strategy"] == "auto"]
    assert {r["world_size"] for r in auto} == {1, 2, 16, 1024}
    assert all(r["chosen"] in cm.GPU_INITIATED for r in auto)
    flat = doc["flatness"]["gla"]["fwd"]
    assert flat["P"] == 1024 and flat["auto_ratio"] >= 1.0 and flat["chain_ratio"] > 1.0
    assert set(flat["picks"]) == {2, 16, 1024}

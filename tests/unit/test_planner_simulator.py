"""The cluster simulator (cluster/planner/simulator.py) against queueing theory, its drains, the
planner against a fixed split on a bursty trace, and the `simulate` / `plan` commands."""
from __future__ import annotations

import math

import pytest

from cluster.launch.cli import load, main
from cluster.planner.costs import DeviceProfile
from cluster.planner.rule import FixedRule, RuleConfig, SlaRule
from cluster.planner.simulator import SimConfig, Simulator
from cluster.planner.traces import Shape, TraceRequest, agent, bursty, poisson
from router.policy import WorkerView, make_policy

FLAT = DeviceProfile(prefill_tokens=(1, 1000), prefill_seconds=(0.1, 0.1), decode_batch_sizes=(1, 64),
                     decode_contexts=(1, 4096), decode_step_s=((0.02, 0.02), (0.02, 0.02)),
                     kv_bytes_per_token=1000, kv_transfer_bytes_per_s=1e8, max_num_seqs=64,
                     max_num_batched_tokens=100, worker_start_s=5.0)
COSTS = DeviceProfile(prefill_tokens=(16, 1024, 2048), prefill_seconds=(0.01, 0.2, 0.4),
                      decode_batch_sizes=(1, 64), decode_contexts=(128, 2048), decode_step_s=((0.01, 0.012), (0.03, 0.04)),
                      kv_bytes_per_token=1000, kv_transfer_bytes_per_s=1e9, max_num_seqs=64, worker_start_s=5.0)


def run(costs, cfg, trace, rule=None):
    sim = Simulator(costs, cfg, make_policy("prefix_aware"), WorkerView, rule)
    return sim, sim.run(trace)


def test_one_prefill_worker_queues_as_m_d_1_predicts():
    """Poisson arrivals, one worker, a fixed 0.1 s prefill, one prompt a pass: M/D/1, whose mean
    time in system is S + rho S / (2 (1 - rho))."""
    rate, service = 7.0, 0.1
    trace = poisson(rate, 1200, Shape(input_tokens=100, output_tokens=1, spread=0.0), seed=3)
    sim, result = run(FLAT, SimConfig(1, 1, ttft_slo_s=10, itl_slo_s=1), trace)
    measured = sum(r.first_token_s - r.arrival_s for r in sim.requests) / len(sim.requests)
    rho = rate * service
    expected = service + rho * service / (2 * (1 - rho))
    assert result.completed == len(trace)
    assert math.isclose(measured, expected, rel_tol=0.1), (measured, expected)


def test_a_decode_batch_steps_every_sequence_together():
    """A flat step cost: every sequence's ITL is the step, plus its KV transfer spread over it."""
    trace = poisson(2.0, 60, Shape(input_tokens=100, output_tokens=51, spread=0.0))
    _, result = run(FLAT, SimConfig(1, 1, ttft_slo_s=10, itl_slo_s=1), trace)
    transfer = 100 * 1000 / 1e8 / 50
    assert math.isclose(result.itl_p50_s, 0.02 + transfer, rel_tol=0.05), result
    assert result.goodput == 1.0


def test_removing_and_switching_workers_mid_run_loses_no_request():
    trace = poisson(20.0, 30, Shape(input_tokens=512, output_tokens=64))
    sim = Simulator(COSTS, SimConfig(2, 3, ttft_slo_s=10, itl_slo_s=1), make_policy("prefix_aware"), WorkerView)
    result = _run_with_actions(sim, trace, [(10.0, lambda: sim.remove("decode-0")),
                                            (12.0, lambda: sim.switch("decode-1", "prefill")),
                                            (14.0, lambda: sim.add("decode"))])
    assert result.completed == len(trace)
    roles = {w.name: (w.role, w.state.value) for w in sim.workers.values()}
    assert roles["decode-0"][1] == "gone" and roles["decode-1"] == ("prefill", "serving")
    assert roles["decode-3"] == ("decode", "serving")


def _run_with_actions(sim, trace, actions):
    todo = list(actions)
    original = sim._tick

    def tick(obj=None, extra=None):
        while todo and todo[0][0] <= sim.now:
            todo.pop(0)[1]()
        original(obj, extra)
    sim._tick = tick
    return sim.run(trace)


def test_the_planner_keeps_more_of_a_bursty_load_within_slo_than_the_mean_split():
    """Dynamo #10528's shape: 1-24 req/s around 12.5, a 3 s TTFT SLO."""
    trace = bursty(12.5, 120, Shape(input_tokens=1024, output_tokens=128), amplitude=0.9, period_s=60)
    cfg = SimConfig(3, 2, ttft_slo_s=3.0, itl_slo_s=0.05)
    _, fixed = run(COSTS, cfg, trace, FixedRule())
    _, planned = run(COSTS, cfg, trace, SlaRule(RuleConfig(3.0, 0.05, max_workers=12), COSTS))
    assert planned.goodput >= 0.9 > fixed.goodput, (planned, fixed)
    assert planned.ttft_p50_s < 1.0 and fixed.ttft_p99_s > 3.0


def test_the_agent_trace_reuses_shared_prefixes():
    trace = agent(4.0, 60, Shape(input_tokens=64, output_tokens=16), prefixes=2, prefix_tokens=1024)
    sim, result = run(COSTS, SimConfig(2, 2, ttft_slo_s=3, itl_slo_s=0.05), trace)
    computed = sum(r.compute_tokens for r in sim.requests)
    assert result.completed == len(trace)
    assert computed < 0.5 * sum(r.trace.input_tokens for r in sim.requests)


def test_simulate_and_plan_print_their_figures(capsys):
    assert main(["simulate", "--trace", "bursty", "--rate", "3", "--workers", "6", "--duration", "30"]) == 0
    out = capsys.readouterr().out
    assert out.count("goodput") == 2 and "sla" in out and "fixed" in out
    assert main(["plan", "--rate", "2", "--ttft-slo", "2", "--itl-slo", "0.2"]) == 0
    out = capsys.readouterr().out
    assert "split:" in out and "memory per worker: weights" in out and "simulated (Poisson" in out


@pytest.mark.parametrize("argv", [["simulate", "--rate", "0", "--workers", "2"],
                                  ["plan", "--rate", "1", "--ttft-slo", "-1"]])
def test_refused_planner_flags_exit_2(argv):
    with pytest.raises(SystemExit) as err:
        main(argv)
    assert err.value.code == 2


def test_the_planner_settings_reach_the_config_and_sla_is_refused_where_no_admin_can_act(capsys):
    cfg = load(["serve", "--ttft-slo", "1.5", "--itl-slo", "0.05", "--max-workers", "4", "--planner-interval", "10"],
               check_machine=False).config.planner
    assert (cfg.mode, cfg.ttft_slo_s, cfg.itl_slo_s, cfg.max_workers, cfg.interval_s) == ("off", 1.5, 0.05, 4, 10.0)
    assert main(["serve", "--planner", "sla", "--colocated"]) == 2
    assert "--planner sla: sizes a disaggregated cluster's prefill and decode pools" in capsys.readouterr().err
    assert main(["serve", "--planner", "sla", "--frontends", "2"]) == 2
    assert main(["serve", "--max-workers", "1"]) == 2


@pytest.mark.parametrize("output_tokens", [1, 16])
def test_a_colocated_worker_finishes_every_request_once(output_tokens):
    trace = poisson(2.0, 30, Shape(input_tokens=64, output_tokens=output_tokens))
    sim, result = run(COSTS, SimConfig(0, 2, ttft_slo_s=10, itl_slo_s=1, colocated=True), trace)
    assert result.completed == sim.completed == len(trace)
    assert min(r.first_token_s - r.arrival_s for r in sim.requests) >= COSTS.prefill_time(32) * 0.99


def test_a_colocated_step_prefills_every_queued_prompt_the_budget_holds():
    """As the engine's scheduler admits waiting prompts while its token budget lasts: four 128-token
    prompts arriving together in one 2,048-token step come out together, after one pass of 512."""
    trace = [TraceRequest(0.0, 128, 4) for _ in range(4)]
    sim, result = run(COSTS, SimConfig(0, 1, ttft_slo_s=10, itl_slo_s=1, colocated=True), trace)
    assert result.completed == 4
    firsts = sorted(r.first_token_s for r in sim.requests)
    # the first arrival starts a pass alone (the worker is idle); the other three share the next,
    # beside the first one's decode token (385 tokens in that step)
    assert firsts[0] == pytest.approx(COSTS.prefill_time(128))
    assert firsts[1] == firsts[2] == firsts[3] == pytest.approx(COSTS.prefill_time(128) + COSTS.prefill_time(385))

"""Instruction programs and the static deadlock check (pure Python, no torch)."""

from __future__ import annotations

import random

import pytest

from megatron_envpipe.core.deadlock import check_deadlock
from megatron_envpipe.core.instructions import (
    Backward,
    CommInstruction,
    DeadlockError,
    Forward,
    Free,
    RecvActivationFinish,
    RecvActivationStart,
    RecvGradFinish,
    RecvGradStart,
    SendActivationFinish,
    SendActivationStart,
    SendGradFinish,
    SendGradStart,
    SetFrequency,
    StageProgram,
    _parse_instruction,
    build_programs,
    paired_hold_dependencies,
)
from megatron_envpipe.core.schedule import Schedule, _stage_order, envpipe_schedule, one_f_one_b
from megatron_envpipe.planning.envpipe import initial_plan


def random_schedule(rng: random.Random, max_stages: int = 16, max_microbatches: int = 64) -> Schedule:
    p = rng.randint(1, max_stages)
    m = rng.randint(1, max_microbatches)
    if rng.random() < 0.2:
        return one_f_one_b(p, m)
    # Any non-increasing r within M-(P-s), saturated stages included.
    r, prev = [], m
    for s in range(p - 1):
        cap = min(prev, max(0, m - (p - s)))
        value = rng.choice([cap, rng.randint(0, cap)]) if cap > 0 else 0
        r.append(value)
        prev = value
    r.append(0)
    return envpipe_schedule(p, m, r)


# The first 200 plans in the fast tier, the other 1,800 in the full suite (one sequence, each plan once).
@pytest.mark.parametrize("first,stop", [(0, 200), pytest.param(200, 2000, marks=pytest.mark.slow)],
                         ids=["plans-0-199", "plans-200-1999"])
def test_property_thousands_of_random_plans_are_deadlock_free(first: int, stop: int):
    rng = random.Random(2024)
    for i in range(stop):
        sched = random_schedule(rng)
        prefetch = rng.choice([1, 2, 3])
        if i < first:
            continue  # drawn only to keep the sequence
        programs = build_programs(sched, prefetch=prefetch)
        check_deadlock(programs)
        for prog, order in zip(programs, sched.orders):
            assert tuple(prog.units()) == order  # each stage runs exactly its schedule


def test_saturated_exception_is_deadlock_free_with_per_direction_channels():
    # EnvPipe's clamp exception (envpipe.md §8.3): stage 0 saturated at r=M-(P-0)=2, then r_1=3 > r_0.
    # It deadlocks with the KISTI order; with one channel per direction it does not.
    p, m, r = 4, 6, [2, 3, 1, 0]
    orders = tuple(_stage_order(m, p - s - 1 + r[s]) for s in range(p))
    sched = Schedule(m, orders, name="ours-exception", extra_warmup=tuple(r)).validate()
    check_deadlock(build_programs(sched))


def naive_blocking_programs(schedule: Schedule) -> list[StageProgram]:
    """Each receive and send as a separate blocking call around each unit.

    Megatron's reference notes measured that even 1F1B deadlocks this way.
    """
    p = schedule.num_stages
    programs = []
    for s, order in enumerate(schedule.orders):
        out = []
        for unit in order:
            mb = unit.microbatch
            if unit.is_forward:
                if s > 0:
                    out += [RecvActivationStart(mb), RecvActivationFinish(mb)]
                out.append(Forward(mb))
                if s < p - 1:
                    out += [SendActivationStart(mb), SendActivationFinish(mb)]
            else:
                if s < p - 1:
                    out += [RecvGradStart(mb), RecvGradFinish(mb)]
                out.append(Backward(mb))
                if s > 0:
                    out += [SendGradStart(mb), SendGradFinish(mb)]
        programs.append(StageProgram(s, tuple(out)))
    return programs


def test_checker_catches_known_deadlocks():
    for sched in (one_f_one_b(4, 8), envpipe_schedule(4, 8, [4, 3, 1, 0])):
        with pytest.raises(DeadlockError, match=r"deadlock: stage \d blocked at"):
            check_deadlock(naive_blocking_programs(sched), shared_pair_stream=True)
    # Our programs rely on separate channels: on one shared per-pair stream they block.
    with pytest.raises(DeadlockError):
        check_deadlock(build_programs(one_f_one_b(4, 8)), shared_pair_stream=True)


def test_checker_catches_order_and_matching_errors():
    progs = build_programs(one_f_one_b(2, 2))
    # Swap two activation sends on stage 0: the receiver expects micro-batch 0 first.
    ins = list(progs[0].instructions)
    a, b = ins.index(SendActivationStart(0)), ins.index(SendActivationStart(1))
    ins[a], ins[b] = ins[b], ins[a]
    with pytest.raises(DeadlockError):
        check_deadlock([StageProgram(0, tuple(ins)), progs[1]])
    # A receive that nobody sends.
    extra = StageProgram(1, progs[1].instructions + (RecvActivationStart(5), RecvActivationFinish(5)))
    with pytest.raises(DeadlockError, match="RecvActivationFinish\\(5\\)"):
        check_deadlock([progs[0], extra])


def test_programs_shape_1f1b_last_and_first_stage():
    progs = build_programs(one_f_one_b(3, 3))
    first, last = progs[0].instructions, progs[2].instructions
    assert not any(isinstance(i, (RecvActivationStart, SendGradStart)) for i in first)
    assert not any(isinstance(i, (SendActivationStart, RecvGradStart)) for i in last)
    # Receives are waited immediately before the unit that consumes them.
    for prog in progs:
        ins = prog.instructions
        for k, i in enumerate(ins):
            if isinstance(i, RecvActivationFinish):
                assert ins[k + 1 :][0] == Forward(i.microbatch) or isinstance(ins[k + 1], RecvActivationStart)
            if isinstance(i, Backward):
                assert Free(i.microbatch) in ins[k + 1 : k + 3]
    # All gradient sends are finished at the end of the iteration.
    assert [str(i) for i in progs[1].instructions[-3:]] == ["SendGradFinish(0)", "SendGradFinish(1)", "SendGradFinish(2)"]


def test_prefetch_bounds_posted_receives():
    sched = envpipe_schedule(4, 16, [6, 4, 2, 0])
    for prefetch in (1, 2, 4):
        for prog in build_programs(sched, prefetch=prefetch):
            outstanding = peak = 0
            for i in prog.instructions:
                if isinstance(i, RecvActivationStart):
                    outstanding += 1
                elif isinstance(i, RecvActivationFinish):
                    outstanding -= 1
                peak = max(peak, outstanding)
            assert peak <= prefetch + 1


def test_set_frequency_only_on_changes():
    sched = one_f_one_b(3, 4)
    plan = initial_plan(sched, "envelope", 1740, [900, 900, 900])
    progs = build_programs(sched, plan)
    s0 = [i for i in progs[0].instructions if isinstance(i, SetFrequency)]
    assert s0 == [SetFrequency(1740), SetFrequency(900), SetFrequency(1740)]
    assert [i for i in progs[2].instructions if isinstance(i, SetFrequency)] == [SetFrequency(1740)]
    # The clock is set before the unit's receive wait, so the wait runs at the unit's clock too.
    ins = progs[1].instructions
    k = ins.index(SetFrequency(900))
    assert isinstance(ins[k + 1], (RecvActivationFinish, RecvActivationStart))
    with pytest.raises(Exception, match="different schedule"):
        build_programs(one_f_one_b(3, 5), plan)


def test_print_and_parse():
    progs = build_programs(one_f_one_b(2, 3), initial_plan(one_f_one_b(2, 3), "uniform", 1740, [1200, 1300]))
    for prog in progs:
        text = str(prog)
        assert text.startswith(f"S{prog.stage}: ") and "SetFrequency(" in text
        parsed = tuple(_parse_instruction(t) for t in text.split(": ", 1)[1].split())
        assert parsed == prog.instructions
    assert _parse_instruction("SendGradFinish(4)") == SendGradFinish(4)
    assert SendGradFinish(4).channel(2) == (2, 1, "grad")


def test_paired_hold_dependencies_follow_the_85_pairing():
    sched = envpipe_schedule(4, 8, [4, 3, 1, 0])
    deps = paired_hold_dependencies(sched)
    # Stage 2 warms up with w=1 (2 forwards before B0): stage 1... stage 2 holds F(3,i) for i>=2.
    held = sorted(d.dst.microbatch for d in deps if d.dst_stage == 3)
    assert held == list(range(1, 8))
    assert all(d.src_stage + 1 == d.dst_stage for d in deps)
    # 1F1B: downstream warm-up is exactly one less, so the pairing holds each act until B(j).
    assert paired_hold_dependencies(one_f_one_b(4, 8))


def simulate_programs(programs, dur):
    """Time the instruction programs themselves: compute takes its duration, a
    receive finishes once the peer has posted the send, a send once the peer
    has posted the receive. Returns each unit's start time, and the sends that
    had to wait for their receive."""
    n = len(programs)
    pc, now = [0] * n, [0.0] * n
    posted: dict = {}
    starts: dict = {}
    send_waits: list = []  # sends that waited for their receive: only trailing gradient sends
    while any(pc[s] < len(programs[s].instructions) for s in range(n)):
        progressed = False
        for s in range(n):
            while pc[s] < len(programs[s].instructions):
                i = programs[s].instructions[pc[s]]
                if isinstance(i, CommInstruction):
                    if i.is_start:
                        posted[(s, i.kind, i.is_send, i.microbatch)] = now[s]
                    else:
                        peer_key = (i.peer(s), i.kind, not i.is_send, i.microbatch)
                        if peer_key not in posted:
                            break
                        if not i.is_send:
                            # A receive completes when the data was sent: it may hold its stage up.
                            now[s] = max(now[s], posted[peer_key])
                        elif posted[peer_key] > now[s]:
                            # A send completes once its receive is posted. The timeline has no
                            # send edge, so a send that waits may only be followed by other
                            # send waits (the gradient sends at the end), never by a unit.
                            rest = programs[s].instructions[pc[s] + 1:]
                            assert not any(isinstance(j, (Forward, Backward)) for j in rest), (s, i)
                            assert not isinstance(i, SendActivationFinish), (s, i)  # "never blocks"
                            now[s] = posted[peer_key]
                            send_waits.append((s, i))
                elif isinstance(i, (Forward, Backward)):
                    unit = ("F" if isinstance(i, Forward) else "B", i.microbatch)
                    starts[(s, unit)] = now[s]
                    now[s] += dur[(s, unit)]
                pc[s] += 1
                progressed = True
        assert progressed, "programs deadlocked"
    return starts, send_waits


def test_timeline_models_exactly_what_the_programs_impose():
    from megatron_envpipe.core.timeline import PipelineGraph

    rng = random.Random(9)
    checked = waited = 0
    for _ in range(150):
        sched = random_schedule(random.Random(rng.random()))
        if sched.num_stages > 8 or sched.num_microbatches > 24:
            continue
        dur = {(s, (u.kind, u.microbatch)): rng.uniform(0.1, 2.0) for s, o in enumerate(sched.orders) for u in o}
        graph = PipelineGraph(sched)
        tl = graph.simulate([dur[(s, (u.kind, u.microbatch))] for s, u in graph.nodes])
        starts, send_waits = simulate_programs(build_programs(sched, prefetch=rng.choice([1, 2])), dur)
        assert len(starts) == len(graph.nodes)
        for v, (s, u) in enumerate(graph.nodes):
            assert starts[(s, (u.kind, u.microbatch))] == pytest.approx(tl.start_s[v], abs=1e-9)
        checked += 1
        waited += bool(send_waits)
    # Enough multi-stage schedules were compared, and the send-wait branch was exercised.
    assert checked >= 30 and waited > 0, (checked, waited)


def test_paired_hold_costs_energy_in_planning(gpt3_profile):
    from megatron_envpipe.core.gpu_specs import get_gpu_spec
    from megatron_envpipe.planning.basis import PlannerConfig
    from megatron_envpipe.planning.planner import plan_envpipe

    gpu = get_gpu_spec("a40")
    ours = plan_envpipe(gpt3_profile, 24, PlannerConfig("envelope", "ours", "balanced", gpu=gpu))
    held = plan_envpipe(gpt3_profile, 24, PlannerConfig("envelope", "ours", "balanced", gpu=gpu, comm="paired"))
    assert ours.energy_saving > held.energy_saving + 0.02


# --------------------------------------------------------------------------- model chunks (interleaved)


def interleaved_cases():
    from megatron_envpipe.core.interleaved import interleaved_schedule

    for p in (2, 3, 4, 5):
        for v in (2, 3):
            for m in (p, 2 * p, 4 * p):
                yield interleaved_schedule(p, m, v)
            # Groups of N = P + 1 with a last group of P (Megatron accepts M mod N >= P).
            yield interleaved_schedule(p, 3 * (p + 1) + p, v, p + 1)


def test_chunk_instructions_print_parse_and_name_the_wrap_around_peer():
    assert str(Forward(3)) == "Forward(3)" and str(Forward(3, 1)) == "Forward(3,1)"
    assert str(SetFrequency(1410)) == "SetFrequency(1410)"
    for text in ("Forward(3,1)", "Backward(0,2)", "RecvActivationStart(5,1)", "SendGradFinish(4)", "Free(2,1)"):
        assert str(_parse_instruction(text)) == text
    for bad in ("SetFrequency(1,2)", "Forward(1,2,3)", "Forward(a)", "Forward()"):
        with pytest.raises(Exception, match="cannot parse"):
            _parse_instruction(bad)
    # Rank P-1's chunk 0 sends to rank 0's chunk 1: one message, named alike on both ends.
    send, recv = SendActivationStart(2, 0), RecvActivationStart(2, 1)
    assert send.channel(3, 4) == recv.channel(0, 4) == (3, 0, "act")
    assert send.message(3, 4) == recv.message(0, 4) == ("act", 2, 3)
    grad_send, grad_recv = SendGradStart(2, 1), RecvGradStart(2, 0)
    assert grad_send.channel(0, 4) == grad_recv.channel(3, 4) == (0, 3, "grad")
    assert grad_send.message(0, 4) == grad_recv.message(3, 4)
    # At P = 2 the wrap-around channels differ from the neighbour channels of the same pair.
    assert SendActivationStart(0, 0).channel(1, 2) == (1, 0, "act") != SendActivationStart(0, 0).channel(0, 2)
    assert SendGradStart(0, 1).channel(0, 2) == (0, 1, "grad") != SendGradStart(0, 0).channel(1, 2)


def test_interleaved_programs_follow_the_schedule_and_are_deadlock_free_with_lazy_communicators():
    from megatron_envpipe.core.communicators import warmup_programs

    checked = 0
    for sched in interleaved_cases():
        p, v = sched.num_stages, sched.num_chunks
        for prefetch in (1, 2):
            programs = build_programs(sched, prefetch=prefetch)
            assert [tuple(prog.units()) for prog in programs] == list(sched.orders)
            check_deadlock(programs)
            check_deadlock(programs, lazy_communicators=True, warmup=warmup_programs(p, wrap=True))
            checked += 1
        # Only virtual stage 0 has no input, only the last no output gradient.
        first, last = programs[0].instructions, programs[-1].instructions
        assert not any(isinstance(i, RecvActivationFinish) and i.chunk == 0 for i in first)
        assert sum(isinstance(i, RecvActivationFinish) for i in first) == (v - 1) * sched.num_microbatches
        assert not any(isinstance(i, SendActivationStart) and i.chunk == v - 1 for i in last)
        assert sum(isinstance(i, SendGradStart) for i in first) == (v - 1) * sched.num_microbatches
    assert checked >= 40


def test_interleaved_programs_need_the_wrap_around_warmup():
    """Without the wrap-around channels in the warm-up, their first uses can form a cycle (P = 2)."""
    from megatron_envpipe.core.communicators import warmup_programs
    from megatron_envpipe.core.interleaved import interleaved_schedule

    failures = 0
    for p in (2, 3, 4):
        programs = build_programs(interleaved_schedule(p, 2 * p, 2))
        try:
            check_deadlock(programs, lazy_communicators=True, warmup=warmup_programs(p))
        except DeadlockError:
            failures += 1
    assert failures  # the wrap-around warm-up above is what makes them safe


def test_wrong_receive_order_on_the_wrap_channel_is_caught():
    from megatron_envpipe.core.interleaved import interleaved_schedule

    programs = build_programs(interleaved_schedule(2, 4, 2), prefetch=1)
    first = list(programs[0].instructions)
    starts = [k for k, i in enumerate(first) if isinstance(i, RecvActivationStart)]
    a, b = starts[0], starts[1]
    first[a], first[b] = first[b], first[a]  # rank 0 posts its wrap-around receives out of order
    with pytest.raises(DeadlockError):
        check_deadlock([StageProgram(0, tuple(first)), programs[1]])


def test_interleaved_timeline_models_exactly_what_the_programs_impose():
    """The chunk-aware DAG (wrap-around edges included) times units exactly as the programs run them."""
    from megatron_envpipe.core.timeline import PipelineGraph

    rng = random.Random(14)
    for sched in interleaved_cases():
        p = sched.num_stages
        dur = {(s, u): rng.uniform(0.1, 2.0) for s, o in enumerate(sched.orders) for u in o}
        graph = PipelineGraph(sched)
        tl = graph.simulate([dur[(s, u)] for s, u in graph.nodes])
        programs = build_programs(sched, prefetch=rng.choice([1, 2]))
        pc, now, done = [0] * p, [0.0] * p, [0] * p
        units = [prog.units() for prog in programs]
        posted: dict = {}
        starts: dict = {}
        while any(pc[s] < len(programs[s].instructions) for s in range(p)):
            progressed = False
            for s in range(p):
                while pc[s] < len(programs[s].instructions):
                    i = programs[s].instructions[pc[s]]
                    if isinstance(i, CommInstruction):
                        key = (i.message(s, p), i.is_send)
                        if i.is_start:
                            posted[key] = now[s]
                        else:
                            peer = (i.message(s, p), not i.is_send)
                            if peer not in posted:
                                break
                            if not i.is_send:
                                now[s] = max(now[s], posted[peer])
                    elif isinstance(i, (Forward, Backward)):
                        unit = units[s][done[s]]
                        done[s] += 1
                        starts[(s, unit)] = now[s]
                        now[s] += dur[(s, unit)]
                    pc[s] += 1
                    progressed = True
            assert progressed, "programs deadlocked"
        for node, (s, u) in enumerate(graph.nodes):
            assert starts[(s, u)] == pytest.approx(tl.start_s[node], abs=1e-9), (p, sched.num_microbatches, s, u)

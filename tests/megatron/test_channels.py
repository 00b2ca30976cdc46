"""P2P channel groups: which torch calls create them, and the warm-up that first uses them.

Group creation runs on every rank of a fake world (``bench/comm_groups.py``:
one thread per rank, a stand-in for ``torch.distributed`` that follows torch
2.13's rules and counts calls). The warm-up runs on real gloo ranks, and the
order it used is fed to the lazy-communicator model together with the
programs.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="needs torch")

import torch.distributed as dist  # noqa: E402

from megatron_envpipe.config import TransportSettings  # noqa: E402
from megatron_envpipe.core import instructions as ins  # noqa: E402
from megatron_envpipe.core.communicators import creation_order, disjoint_classes, warmup_order  # noqa: E402
from megatron_envpipe.core.deadlock import check_deadlock  # noqa: E402
from megatron_envpipe.core.instructions import build_programs  # noqa: E402
from megatron_envpipe.core.schedule import envpipe_schedule, one_f_one_b  # noqa: E402
from megatron_envpipe.megatron import channels  # noqa: E402
from megatron_envpipe.testing.harness import join_ranks, start_ranks  # noqa: E402

BENCH = Path(__file__).resolve().parents[2] / "bench" / "comm_groups.py"


def _load_bench():
    spec = importlib.util.spec_from_file_location("envpipe_bench_comm_groups", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


fake = _load_bench()


def world(stages: int, pipelines: int, **kwargs):
    return fake.FakeWorld(fake.megatron_layout(stages, pipelines),
                          extra_groups=fake.megatron_extra_groups(stages, pipelines), **kwargs)


@pytest.mark.parametrize(("backend", "eager", "strategy"), [
    ("gloo", False, channels._WORLD_GROUPS),
    ("nccl", False, channels._WORLD_GROUPS),
    ("nccl", True, channels._SPLIT),
    ("ucc", True, channels._PER_PAIR),  # a bound device, but a pipeline group that cannot split
])
def test_strategy_follows_the_backend_and_device_binding(backend, eager, strategy):
    made = world(3, 2, backend=backend, eager=eager).run(
        lambda api: channels._create_channel_groups(api.world.pp[api.rank], api))
    assert {m.strategy for m in made} == {strategy}


@pytest.mark.parametrize(("stages", "pipelines"), [(2, 1), (3, 3), (4, 2), (5, 2)])
def test_world_wide_calls_per_strategy(stages, pipelines):
    per_pair = fake.tally(world(stages, pipelines), channels._per_pair_groups)
    assert per_pair.world_calls == 1 + 2 * (stages - 1) * pipelines  # the gather + two new_group per pair
    lazy = fake.tally(world(stages, pipelines), channels._create_channel_groups)
    assert (lazy.world_calls, lazy.world_syncs, lazy.smaller_collectives) == (2, 0, 0)
    eager = world(stages, pipelines, eager=True)
    split = fake.tally(eager, channels._create_channel_groups)
    padding = 2 if stages > 2 else 1  # first stages hold two more groups than middle ones, one more than last
    over_pipeline = 1 + padding + len(disjoint_classes(stages))  # gather of counts, padding, one split per class
    expected = (over_pipeline, over_pipeline, 0) if pipelines == 1 else (0, 0, over_pipeline)  # one pipeline = world
    assert (split.world_calls, split.world_syncs, split.smaller_collectives) == expected
    for t in (per_pair, lazy, split):
        assert t.name_mismatches == 0


def test_the_1024_rank_counts_of_the_note():
    # 1,024 ranks, P = 8, DP = 128: 1 + 2 x 7 x 128 = 1,793 world-wide calls before; 2 or 0 after.
    assert 1 + 2 * 7 * 128 == 1793
    big = fake.tally(world(8, 128, eager=True), channels._create_channel_groups)
    assert (big.world_calls, big.world_syncs, big.smaller_collectives, big.name_mismatches) == (0, 0, 7, 0)


def test_split_group_names_differ_on_a_pair_without_the_padding():
    # torch 2.13 salts a split group's hashed name with the rank's own count of groups; Megatron's
    # embedding groups make that count differ, so without padding the two ends disagree.
    w = world(4, 2, eager=True)

    def unpadded(pp_group, api):
        api.distributed_c10d = None  # _registered_group_count() cannot tell: no padding
        return channels._split_pipeline_groups(pp_group, api)

    assert fake.tally(w, unpadded).name_mismatches > 0


def test_each_rank_holds_the_groups_of_its_own_pairs():
    for eager in (False, True):
        w = world(4, 2, eager=eager)
        made = w.run(lambda api: channels._create_channel_groups(api.world.pp[api.rank], api))
        for ranks in w.pipelines:
            for s, rank in enumerate(ranks):
                mine = made[rank]
                assert mine.stage == s and mine.ranks == tuple(ranks)
                assert set(mine.act) == set(mine.grad) == {x for x in (s - 1, s) if 0 <= x < 3}
            for snd, rcv, kind in creation_order(4):
                lo = min(snd, rcv)
                ends = [getattr(made[ranks[x]], kind)[lo] for x in (snd, rcv)]
                assert ends[0].group_name == ends[1].group_name
                # Split: a group of the pair; lazy: the world-sized group of that direction (8 ranks).
                assert sorted(ends[0].ranks) == sorted([ranks[snd], ranks[rcv]]) or (not eager and ends[0].size() == 8)


def test_the_fake_follows_torchs_rules():
    w = world(2, 1, eager=True)
    with pytest.raises(RuntimeError, match="hangs"):
        w.run(lambda api: api.new_group([0, 1], use_local_synchronization=True))
    lazy = world(2, 1)
    with pytest.raises(RuntimeError, match="not safe to split"):
        lazy.run(lambda api: api.split_group(api.world.pp[api.rank], [[0, 1]]))


# -- the warm-up on real gloo ranks ------------------------------------------------------------
def _rank_main(rank: int, world_size: int, port: int, stages: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        pipelines = world_size // stages
        pp_groups = [dist.new_group([d + s * pipelines for s in range(stages)]) for d in range(pipelines)]
        chans = channels.PipelineChannels(pp_groups[rank % pipelines])
        s = chans.stage
        # A group carries one kind; with the direction of the message that names the channel.
        kind_of = {id(g): ins.ACT for g in chans.act.values()} | {id(g): ins.GRAD for g in chans.grad.values()}
        channel_of = {(ins.ACT, True): (s, s + 1, ins.ACT), (ins.ACT, False): (s - 1, s, ins.ACT),
                      (ins.GRAD, True): (s, s - 1, ins.GRAD), (ins.GRAD, False): (s + 1, s, ins.GRAD)}
        used: list[list] = []
        isend, irecv = dist.isend, dist.irecv

        def rec_isend(tensor, dst, group):
            used.append([*channel_of[kind_of[id(group)], True], dst])
            return isend(tensor, dst=dst, group=group)

        def rec_irecv(tensor, src, group):
            used.append([*channel_of[kind_of[id(group)], False], src])
            return irecv(tensor, src=src, group=group)

        dist.isend, dist.irecv = rec_isend, rec_irecv
        try:
            chans.warm_up(torch.device("cpu"), datetime.timedelta(seconds=60))
            chans.warm_up(torch.device("cpu"), datetime.timedelta(seconds=60))  # once only
        finally:
            dist.isend, dist.irecv = isend, irecv
        # Then one message each way over every channel of the stage, routed as the executor routes them.
        transfers = channels.P2PTransfers(chans, s, stages, transport=TransportSettings(prefetch=2, comm_timeout_s=60),
                                          recv_shape=(2,), send_shape=(2,),
                                          dtype=torch.float32, device=torch.device("cpu"))
        first, last = s == 0, s == stages - 1
        if not first:
            transfers.start_recv(ins.RecvActivationStart(0))
        if not last:
            transfers.start_recv(ins.RecvGradStart(0))
            transfers.start_send(ins.SendActivationStart(0), torch.full((2,), float(rank)))
        if not first:
            transfers.start_send(ins.SendGradStart(0), torch.full((2,), float(-rank)))
        got = {}
        if not first:
            got["act"] = transfers.finish(ins.RecvActivationFinish(0))[0].item()
            transfers.finish(ins.SendGradFinish(0))
        if not last:
            got["grad"] = transfers.finish(ins.RecvGradFinish(0))[0].item()
            transfers.finish(ins.SendActivationFinish(0))
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(
            {"stage": s, "strategy": chans.strategy, "used": used, "got": got, "ranks": chans.ranks}))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("stages", "pipelines"), [(4, 1), (3, 2)])
def test_warm_up_runs_the_chain_order_on_gloo_and_the_lazy_model_proves_it(tmp_path, stages, pipelines):
    world_size = stages * pipelines
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    # Fresh processes forked from the harness's forkserver (torch imported once there, not per rank).
    join_ranks(start_ranks(_rank_main, (world_size, store.port, stages, str(tmp_path)), world_size), timeout_s=300)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world_size)]
    ran: list[list] = [[] for _ in range(stages)]
    for res in results:
        s, ranks = res["stage"], res["ranks"]
        assert res["strategy"] == channels._WORLD_GROUPS
        peers = [ranks[rcv if snd == s else snd] for snd, rcv, _ in warmup_order(s, stages)]
        assert res["used"] == [[*c, peer] for c, peer in zip(warmup_order(s, stages), peers)]  # once, in order
        if s > 0:
            assert res["got"]["act"] == float(ranks[s - 1])
        if s < stages - 1:
            assert res["got"]["grad"] == float(-ranks[s + 1])
        if ranks[0] == 0:  # the first pipeline
            ran[s] = [tuple(u[:3]) for u in res["used"]]
    # What ran is a warm-up under which the lazy model proves the programs deadlock-free.
    for sched in (one_f_one_b(stages, 2 * stages), envpipe_schedule(stages, 2 * stages, [2] * (stages - 1) + [0])):
        check_deadlock(build_programs(sched), lazy_communicators=True, warmup=ran)

"""The order in which a pipeline's P2P communicators are first used (pure Python).

Every neighbouring pair of stages has two channels, one per direction
(:mod:`~megatron_envpipe.core.instructions`), each its own communicator.
Under NCCL a communicator is created lazily, by the first operation either of
its two ranks issues on it, and that creation blocks until the other rank
joins: the first uses are pairwise rendezvous of their own. Left to the
programs they form a cycle: stage 0's first operation is on the gradient
channel from stage 1 (it posts its gradient receives first), stage 1's on the
activation channel from stage 0, and each waits for the other forever.

:func:`creation_order` is one global order of a pipeline's channels, and a
stage's :func:`warmup_order` is the part of it the stage belongs to. When
every stage first touches its channels in that order, before its program, the
first uses form a chain, not a cycle: the earliest channel not yet created has
both of its stages waiting on it, so it always completes.
``check_deadlock(programs, lazy_communicators=True, warmup=warmup_programs(P))``
proves warm-up and programs together.

:func:`disjoint_classes` groups the channels so that no stage appears twice in
a class: one ``split_group`` call (one collective over the pipeline) creates a
whole class.

With model chunks (``wrap=True``) the pipeline also has the wrap-around pair:
activations from stage P-1 to stage 0 and gradients back. Its two channels
come last in the creation order (still a chain) and form classes of their own.

With variable sequence lengths (``shapes=True``) every data channel has a
shape channel beside it (same two stages, same direction, kind ``act_shape``
or ``grad_shape``): a pair's two shape channels follow its two data channels
in the creation order, the wrap-around's shape channels follow its data ones.
Still one global order, so still a chain. Without ``shapes`` nothing changes.
"""

from __future__ import annotations

from megatron_envpipe.core.instructions import ACT, ACT_SHAPE, DOWNSTREAM, GRAD, GRAD_SHAPE

__all__ = ["Channel", "creation_order", "disjoint_classes", "is_wrap", "warmup_order", "warmup_programs"]

# (sending stage, receiving stage, ACT or GRAD), as CommInstruction.channel() names it.
Channel = tuple[int, int, str]


def _pair(up: int, down: int, shapes: bool) -> list[Channel]:
    """The channels of one pair: ``up`` sends activations to ``down``, gradients come back."""
    data = [(up, down, ACT), (down, up, GRAD)]
    return data + [(up, down, ACT_SHAPE), (down, up, GRAD_SHAPE)] if shapes else data


def _wrap_channels(num_stages: int, shapes: bool = False) -> list[Channel]:
    """The wrap-around channels of a pipeline with model chunks: P-1 -> 0 activations, 0 -> P-1 gradients
    (and, with ``shapes``, their shape channels)."""
    if num_stages < 2:
        return []
    return _pair(num_stages - 1, 0, shapes)


def is_wrap(channel: Channel) -> bool:
    """A wrap-around channel: activations going down the stage numbers, or gradients going up."""
    snd, rcv, kind = channel
    return (snd > rcv) == (kind in DOWNSTREAM)


def creation_order(num_stages: int, wrap: bool = False, shapes: bool = False) -> list[Channel]:
    """Every channel of a pipeline, in the one order all stages first use them.

    Pair by pair from the first stage; activations before gradients (with
    ``shapes``, then their shape channels); with ``wrap`` the wrap-around
    pair's channels last.
    """
    out = [c for s in range(num_stages - 1) for c in _pair(s, s + 1, shapes)]
    return out + (_wrap_channels(num_stages, shapes) if wrap else [])


def warmup_order(stage: int, num_stages: int, wrap: bool = False, shapes: bool = False) -> list[Channel]:
    """The channels of ``stage``, in :func:`creation_order` (at most four, six with ``wrap``; twice that
    with ``shapes``)."""
    return [c for c in creation_order(num_stages, wrap, shapes) if stage in c[:2]]


def warmup_programs(num_stages: int, wrap: bool = False, shapes: bool = False) -> list[list[Channel]]:
    """:func:`warmup_order` of every stage (the ``warmup`` of ``check_deadlock``)."""
    return [warmup_order(s, num_stages, wrap, shapes) for s in range(num_stages)]


def disjoint_classes(num_stages: int, wrap: bool = False, shapes: bool = False) -> list[list[Channel]]:
    """The channels in classes in which no stage appears twice, in a fixed order.

    Activations of pairs (0,1), (2,3), ...; their gradients; then the same for
    pairs (1,2), (3,4), ...: four classes from three stages on, two for two
    stages, none for one (twice that with ``shapes``: the shape kinds after the
    data kinds of each parity). With ``wrap``, one class per wrap-around channel after them.
    """
    classes = []
    kinds = (ACT, GRAD, ACT_SHAPE, GRAD_SHAPE) if shapes else (ACT, GRAD)
    for parity in (0, 1):
        for kind in kinds:
            members = [c for c in creation_order(num_stages, shapes=shapes)
                       if c[2] == kind and min(c[:2]) % 2 == parity]
            if members:
                classes.append(members)
    return classes + ([[c] for c in _wrap_channels(num_stages, shapes)] if wrap else [])

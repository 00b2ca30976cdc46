"""What a unit costs against the size of its micro-batch (variable-length micro-batches, issue 25).

A micro-batch's size is :class:`MicrobatchSize`: ``tokens`` (the sum of its sequence lengths) and
``attention_tokens2`` (the sum of their squares: self-attention over packed sequences costs per
sequence the square of its length). :class:`LengthCostModel` scales a profile row, measured at a
reference size, to any size (per stage, chunk, instruction and clock): fitted from measurements at
>= 2 sizes (:func:`fit_length_costs`) or the documented flop-count assumption for the shipped A40
profiles (:func:`_default_length_model`). The profile's optional ``tokens,attention_tokens2`` columns are
parsed here (:func:`parse_row_size`, :func:`split_by_size`) for :mod:`~megatron_envpipe.core.profile`.
Pure Python, stdlib only (docs/variable-lengths.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from megatron_envpipe.errors import UsageError

# Beyond this a token count is a unit mistake or garbage (a sum over an iteration would lose precision).
_MAX_TOKENS = 10**12


class LengthCostError(UsageError, ValueError):
    """A micro-batch size, length sample or length cost model that cannot be used."""


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, order=True)
class MicrobatchSize:
    """The size of one micro-batch: ``tokens`` = sum of its sequence lengths, ``attention_tokens2`` = sum of
    their squares. One packed sequence of length s: (s, s**2); two of s/2: (s, s**2 / 2)."""

    tokens: int
    attention_tokens2: int

    def __post_init__(self) -> None:
        if not (_whole(self.tokens) and _whole(self.attention_tokens2)):
            raise LengthCostError(
                f"a micro-batch size needs whole numbers, got tokens={self.tokens!r}, "
                f"attention_tokens2={self.attention_tokens2!r}"
            )
        if not 0 < self.tokens <= _MAX_TOKENS:
            raise LengthCostError(f"a micro-batch needs 1..{_MAX_TOKENS} tokens, got {self.tokens}")
        # Sequences of whole lengths summing to t: sum of squares lies in t..t**2.
        if not self.tokens <= self.attention_tokens2 <= self.tokens**2:
            raise LengthCostError(
                f"attention_tokens2 (sum of squared sequence lengths) must lie in tokens..tokens**2 = "
                f"{self.tokens}..{self.tokens**2}, got {self.attention_tokens2}"
            )

    @classmethod
    def from_lengths(cls, seq_lengths: Sequence[int]) -> "MicrobatchSize":
        """The size of a micro-batch holding sequences of these lengths (tokens each, all > 0)."""
        lengths = list(seq_lengths)
        if not lengths:
            raise LengthCostError("a micro-batch needs at least one sequence, got no lengths")
        bad = [n for n in lengths if not _whole(n) or n <= 0]
        if bad:
            raise LengthCostError(f"sequence lengths must be whole numbers > 0, got {bad[:5]}")
        return cls(sum(lengths), sum(n * n for n in lengths))

    def __str__(self) -> str:
        return f"{self.tokens} tokens (attention {self.attention_tokens2})"


# -- the cost model ------------------------------------------------------------------------------------

# (stage, chunk, instruction, freq_mhz): the unit type and clock one set of coefficients describes.
LengthKey = tuple[int, int, str, int]

# The attention column counts as collinear with (1, tokens) below this relative residual: the samples
# cannot tell attention from per-token cost (e.g. sequences of one length), so t_att stays 0.
_COLLINEAR_RTOL = 1e-6
# Relative to the largest term, a fitted value below this is 0 (least-squares noise), not negative.
_NEGATIVE_RTOL = 1e-9
# A unit's cost is fixed + per token + per attention token^2, none negative: against the reference size,
# a sample of r_tok x its tokens and r_att x its attention costs between min(1, r_tok, r_att) and
# max(1, r_tok, r_att) times as much. Beyond that, give or take this much measurement noise, it is
# no measurement of that size (a 1024-token micro-batch taking 50x a 2048-token one's time).
_PLAUSIBLE_RTOL = 0.25


@dataclass(frozen=True)
class LengthCoefficients:
    """``value = fixed + per_token * tokens + per_attention_token2 * attention_tokens2``.

    In any unit (seconds, joules, flops): the model only ever uses the ratio of two values
    (:meth:`LengthCostModel.factors`), so coefficients fitted in seconds and ones derived from flops
    are used alike.
    """

    fixed: float
    per_token: float
    per_attention_token2: float = 0.0

    def __post_init__(self) -> None:
        values = (self.fixed, self.per_token, self.per_attention_token2)
        if not all(isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c) for c in values):
            raise LengthCostError(f"length cost coefficients must be finite numbers, got {values}")

    def value(self, size: MicrobatchSize) -> float:
        return self.fixed + self.per_token * size.tokens + self.per_attention_token2 * size.attention_tokens2


@dataclass(frozen=True)
class UnitLengthCost:
    """How one unit type's time and energy grow with its micro-batch's size."""

    time: LengthCoefficients
    energy: LengthCoefficients


@dataclass(frozen=True)
class LengthCostModel:
    """Unit time and energy against the micro-batch's size, as factors on the profile's own rows.

    A unit of micro-batch size ``x`` at clock ``f`` takes ``time_s(ref) * c_t(x) / c_t(ref)`` and uses
    ``energy_j(ref) * c_e(x) / c_e(ref)``, where ``time_s(ref)``, ``energy_j(ref)`` are the profile's plain
    row (measured at ``reference``, the micro-batch size the profile was taken at) and ``c_t``, ``c_e`` the
    key's :class:`LengthCoefficients`. At the reference size the factor is ``c / c == 1.0`` exactly, so the
    model reproduces the profile's rows bit for bit; elsewhere it follows the fit.

    ``costs`` per (stage, chunk, instruction, clock); a key not in it uses its chunk 0 (a profile of whole
    stages split into V equal chunks scales alike: the split does not change ratios), then ``default``.
    """

    reference: MicrobatchSize
    costs: Mapping[LengthKey, UnitLengthCost]
    default: UnitLengthCost | None = None
    source: str = "<memory>"

    def __post_init__(self) -> None:
        if not isinstance(self.reference, MicrobatchSize):
            raise LengthCostError(f"{self.source}: the reference size must be a MicrobatchSize, got {self.reference!r}")
        object.__setattr__(self, "costs", dict(self.costs))
        for key, cost in [*self.costs.items(), *([("default", self.default)] if self.default else [])]:
            for what, coeffs in (("time", cost.time), ("energy", cost.energy)):
                at_ref = coeffs.value(self.reference)
                if not (at_ref > 0 if what == "time" else at_ref >= 0):
                    raise LengthCostError(
                        f"{self.source}: {_where(key)}: {what} at the reference size {self.reference} is "
                        f"{at_ref:g}; it must be > 0: refit from samples that include the reference size"
                    )

    def unit_cost(self, stage: int, chunk: int, instruction: str, freq_mhz: int) -> UnitLengthCost:
        cost = self.costs.get((stage, chunk, instruction, freq_mhz)) or self.costs.get((stage, 0, instruction, freq_mhz))
        if cost is None:
            cost = self.default
        if cost is None:
            raise LengthCostError(
                f"{self.source}: no length costs for {_where((stage, chunk, instruction, freq_mhz))}: fit them "
                "from a profile measured at that clock at >= 2 micro-batch sizes, or use a model with a default"
            )
        return cost

    def factors(self, stage: int, chunk: int, instruction: str, freq_mhz: int, size: MicrobatchSize
                ) -> tuple[float, float]:
        """(time factor, energy factor) of a micro-batch of ``size`` against the reference size."""
        return self.factors_at(stage, chunk, instruction, (freq_mhz,), size)[0]

    def factors_at(self, stage: int, chunk: int, instruction: str, freqs_mhz: Sequence[int], size: MicrobatchSize
                   ) -> list[tuple[float, float]]:
        """:meth:`factors` at each clock of ``freqs_mhz``: computed once per distinct coefficients (a model
        with one default set scales every clock alike), as planners scale every key each iteration."""
        by_cost: dict[int, tuple[float, float]] = {}
        out = []
        for freq in freqs_mhz:
            cost = self.unit_cost(stage, chunk, instruction, freq)
            pair = by_cost.get(id(cost))
            if pair is None:
                pair = by_cost[id(cost)] = self._ratio(cost, size, (stage, chunk, instruction, freq))
            out.append(pair)
        return out

    def scales_alike(self, stage: int, chunk: int, instruction: str, freqs_mhz: Sequence[int]) -> bool:
        """Whether every size scales time and energy at all these clocks by one factor (one set of
        coefficients for time and energy at every clock, like the default model): then a clock that is
        never worth choosing at the reference size is never worth it at any size."""
        costs = {self.unit_cost(stage, chunk, instruction, f) for f in freqs_mhz}
        return len(costs) == 1 and all(c.time == c.energy for c in costs)

    def _ratio(self, cost: UnitLengthCost, size: MicrobatchSize, key: LengthKey) -> tuple[float, float]:
        t_ref, e_ref = cost.time.value(self.reference), cost.energy.value(self.reference)
        t, e = cost.time.value(size), cost.energy.value(size)
        if not t > 0 or e < 0:
            raise LengthCostError(
                f"{self.source}: {_where(key)} at {size}: the model gives time {t:g}, energy {e:g} (time must be "
                "> 0, energy >= 0): the size lies outside the range the model was fitted on"
            )
        return t / t_ref, (e / e_ref if e_ref > 0 else 1.0)


def _where(key: object) -> str:
    if isinstance(key, tuple) and len(key) == 4:
        stage, chunk, instruction, freq = key
        return f"stage {stage}{f' chunk {chunk}' if chunk else ''} {instruction} at {freq} MHz"
    return str(key)


def size_classes(sizes: Sequence[MicrobatchSize]) -> tuple[tuple[int, ...], tuple[MicrobatchSize, ...]]:
    """Per micro-batch its size class, and the classes' sizes (distinct sizes, smallest first): equal
    sizes share one class, so planners build one set of clock options per class, not per micro-batch."""
    distinct = tuple(sorted(set(sizes)))
    index = {size: i for i, size in enumerate(distinct)}
    return tuple(index[size] for size in sizes), distinct


# -- the default model for the shipped A40 profiles ------------------------------------------------------

# Hidden size h of the models the shipped profiles were measured on (data/profiles/SOURCES.md).
_LAYER_WIDTHS = {"gpt3-175b": 12288, "bloom-176b": 14336}
_DEFAULT_REFERENCE_SEQ_LENGTH = 2048
_DEFAULT_FIXED_OVERHEAD = 0.03  # share of a reference unit's cost that does not grow with the size


def _default_length_model(model_name: str, reference_seq_length: int = _DEFAULT_REFERENCE_SEQ_LENGTH,
                         fixed_overhead: float = _DEFAULT_FIXED_OVERHEAD) -> LengthCostModel:
    """The documented length model for a shipped A40 profile: an ASSUMPTION derived from flop counts,
    not measured (fit one with :func:`fit_length_costs` from a profile measured at >= 2 sizes).

    Per transformer layer and token, the dense parts (QKV, projection, MLP) take ~``24 h**2`` flops and
    self-attention ``4 h s`` for a sequence of length s (QK^T and AV), so a micro-batch costs
    ``24 h**2 tokens + 4 h attention_tokens2`` (forward; backward is ~2x both, the same shares). A fixed
    ``fixed_overhead`` share of the reference unit (kernel launches, the embedding, optimizer-free
    overheads) does not scale. Time and energy scale alike (the same clock does the same work at the same
    power), at every stage, chunk and clock. Reference: one sequence of ``reference_seq_length`` (2048:
    the shipped profiles' sequence length) per micro-batch. For GPT-3 at the reference, attention is
    ``s / 6h`` = 2.8 % of the per-token cost, so cost is nearly linear in tokens; a micro-batch of 2048
    tokens packed from short documents costs ~97 % of one 2048-token sequence.
    """
    if model_name not in _LAYER_WIDTHS:
        raise LengthCostError(
            f"no default length model for {model_name!r}; known: {', '.join(sorted(_LAYER_WIDTHS))}"
        )
    if not 0 <= fixed_overhead < 1:
        raise LengthCostError(f"the fixed overhead is a share in [0, 1), got {fixed_overhead}")
    h = _LAYER_WIDTHS[model_name]
    reference = MicrobatchSize.from_lengths([reference_seq_length])
    dense, attention = 24.0 * h * h, 4.0 * h
    scaling = dense * reference.tokens + attention * reference.attention_tokens2
    coeffs = LengthCoefficients(fixed_overhead / (1 - fixed_overhead) * scaling, dense, attention)
    return LengthCostModel(reference, {}, UnitLengthCost(coeffs, coeffs),
                           source=f"default length model ({model_name}, h = {h}, flop counts: assumed)")


def default_length_model_for(profile_source: str) -> LengthCostModel:
    """:func:`_default_length_model` of the shipped profile whose file name ``profile_source`` names."""
    matches = [name for name in _LAYER_WIDTHS if name in str(profile_source)]
    if len(matches) != 1:
        raise LengthCostError(
            f"{profile_source}: no default length model (names none of {', '.join(sorted(_LAYER_WIDTHS))}): "
            "fit one from a profile measured at >= 2 micro-batch sizes"
        )
    return _default_length_model(matches[0])


# -- fitting -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LengthSample:
    """One measurement: a unit type at a clock and micro-batch size took ``time_s`` and used ``energy_j``."""

    stage: int
    chunk: int
    instruction: str
    freq_mhz: int
    size: MicrobatchSize
    time_s: float
    energy_j: float

    def __post_init__(self) -> None:
        if not isinstance(self.size, MicrobatchSize):
            raise LengthCostError(f"a length sample's size must be a MicrobatchSize, got {self.size!r}")
        if not (0 < self.time_s < math.inf and 0 <= self.energy_j < math.inf):
            raise LengthCostError(f"{_where(self.key)} at {self.size}: a sample needs time > 0 s and energy >= 0 J, "
                                  f"finite, got {self.time_s} s, {self.energy_j} J")

    @property
    def key(self) -> LengthKey:
        return (self.stage, self.chunk, self.instruction, self.freq_mhz)


def fit_length_costs(samples: Sequence[LengthSample], reference: MicrobatchSize,
                     source: str = "<samples>") -> LengthCostModel:
    """Least-squares coefficients per (stage, chunk, instruction, clock) from samples at >= 2 distinct sizes.

    Two distinct token counts fit ``(fixed, per_token)`` with no attention term; three or more sizes fit all
    three when the attention column is independent of (1, tokens) (else, e.g. every sample packs sequences
    of one length, the two-term fit). Fitted time must stay > 0 and energy >= 0 at every sampled size
    (a linear model's minimum over their hull lies at one of them), else an error naming the key.
    Least squares in scaled columns (tokens / reference tokens), so the sums stay well-conditioned.
    """
    by_key: dict[LengthKey, list[LengthSample]] = {}
    for sample in samples:
        by_key.setdefault(sample.key, []).append(sample)
    if not by_key:
        raise LengthCostError(f"{source}: no length samples to fit")
    costs = {}
    for key, group in by_key.items():
        sizes = sorted({s.size for s in group})
        if len({size.tokens for size in sizes}) < 2:
            raise LengthCostError(
                f"{source}: {_where(key)} was measured at {len(sizes)} distinct token count(s) "
                f"({', '.join(str(s.tokens) for s in sizes)}); a length fit needs >= 2: profile it at another "
                "micro-batch size"
            )
        _check_plausible(group, reference, source)
        time = _fit(group, lambda s: s.time_s, reference)
        energy = _fit(group, lambda s: s.energy_j, reference)
        for what, coeffs, positive in (("time", time, True), ("energy", energy, False)):
            scale = max(abs(coeffs.fixed), abs(coeffs.per_token * reference.tokens),
                        abs(coeffs.per_attention_token2 * reference.attention_tokens2))
            for size in sizes:
                value = coeffs.value(size)
                if value < -_NEGATIVE_RTOL * scale or (positive and value <= 0):
                    raise LengthCostError(
                        f"{source}: {_where(key)}: the fitted {what} is {value:g} at {size} (must be "
                        f"{'> 0' if positive else '>= 0'} over the sizes fitted): the samples are inconsistent; "
                        "re-measure them"
                    )
        costs[key] = UnitLengthCost(time, energy)
    return LengthCostModel(reference, costs, source=source)


def _check_plausible(group: Sequence[LengthSample], reference: MicrobatchSize, source: str) -> None:
    """Each sample against the group's sample at the reference size (where there is one): see _PLAUSIBLE_RTOL."""
    ref = next((s for s in group if s.size == reference), None)
    for sample in group if ref is not None else ():
        problem = _implausible(sample, ref.time_s, ref.energy_j, reference)
        if problem:
            raise LengthCostError(f"{source}: {problem}")


def _implausible(sample: LengthSample, ref_time_s: float, ref_energy_j: float, reference: MicrobatchSize) -> str | None:
    """Why ``sample`` cannot be a measurement of its size, given its unit's time and energy at ``reference``
    (_PLAUSIBLE_RTOL), or None."""
    r_tok = sample.size.tokens / reference.tokens
    r_att = sample.size.attention_tokens2 / reference.attention_tokens2
    low, high = min(1.0, r_tok, r_att) / (1 + _PLAUSIBLE_RTOL), max(1.0, r_tok, r_att) * (1 + _PLAUSIBLE_RTOL)
    for what, unit, value, at_ref in (("time", "s", sample.time_s, ref_time_s),
                                       ("energy", "J", sample.energy_j, ref_energy_j)):
        if at_ref > 0 and not low <= value / at_ref <= high:
            return (f"{_where(sample.key)} at {sample.size}: {what} {value:g} {unit} is {value / at_ref:.3g}x that at "
                    f"the reference size {reference} ({at_ref:g} {unit}); with {r_tok:.3g}x the tokens and "
                    f"{r_att:.3g}x the attention it can only be {low:.3g}x..{high:.3g}x (no cost falls as a "
                    "micro-batch grows, none grows faster than it): re-measure that row")
    return None


def _fit(group: Sequence[LengthSample], value: Callable[[LengthSample], float],
         reference: MicrobatchSize) -> LengthCoefficients:
    x_tok = [s.size.tokens / reference.tokens for s in group]
    x_att = [s.size.attention_tokens2 / reference.attention_tokens2 for s in group]
    y = [value(s) for s in group]
    ones = [1.0] * len(group)
    two = _least_squares([ones, x_tok], y)
    sizes = {s.size for s in group}
    if len(sizes) >= 3:
        # Is the attention column a combination of (1, tokens)? Its residual against them says.
        fit_att = _least_squares([ones, x_tok], x_att)
        residual = math.sqrt(sum((a - fit_att[0] - fit_att[1] * t) ** 2 for a, t in zip(x_att, x_tok)))
        if residual > _COLLINEAR_RTOL * math.sqrt(sum(a * a for a in x_att)):
            c0, c_tok, c_att = _least_squares([ones, x_tok, x_att], y)
            return LengthCoefficients(c0, c_tok / reference.tokens, c_att / reference.attention_tokens2)
    return LengthCoefficients(two[0], two[1] / reference.tokens, 0.0)


def _least_squares(columns: Sequence[Sequence[float]], y: Sequence[float]) -> list[float]:
    """Coefficients minimising ``|sum_j c_j columns[j] - y|``: the normal equations, by Gaussian
    elimination with partial pivoting (at most 3 unknowns; the columns are scaled to ~1)."""
    k = len(columns)
    a = [[math.fsum(ci * cj for ci, cj in zip(columns[i], columns[j])) for j in range(k)]
         + [math.fsum(ci * yi for ci, yi in zip(columns[i], y))] for i in range(k)]
    for col in range(k):
        pivot = max(range(col, k), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-300:
            raise LengthCostError("the length samples do not determine the fit (singular least squares)")
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(k):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [x - f * p for x, p in zip(a[r], a[col])]
    return [a[i][k] / a[i][i] for i in range(k)]


# -- the optional profile columns -----------------------------------------------------------------------

# Optional Perseus-CSV columns: the size of the micro-batch a row was measured at. Rows without them
# (empty cells, or no such columns) are at the profile's reference size.
SIZE_COLUMNS = ("tokens", "attention_tokens2")


def parse_row_size(row: Mapping[str, str], where: str, error: type[Exception]) -> MicrobatchSize | None:
    """The micro-batch size a profile row gives (None: no size: the reference size); ``error`` (the
    profile's error class) names ``where`` (file:line)."""
    cells = [row.get(c, "") for c in SIZE_COLUMNS]
    if not any(cells):
        return None
    if not all(cells):
        raise error(f"{where}: give both {' and '.join(SIZE_COLUMNS)} or neither (the reference size), got {cells}")
    try:
        numbers = [float(c) for c in cells]
    except ValueError:
        raise error(f"{where}: {'/'.join(SIZE_COLUMNS)} {cells} are not numbers") from None
    if not all(math.isfinite(n) and n.is_integer() for n in numbers):
        raise error(f"{where}: {'/'.join(SIZE_COLUMNS)} {cells} must be whole numbers")
    try:
        return MicrobatchSize(int(numbers[0]), int(numbers[1]))
    except LengthCostError as exc:
        raise error(f"{where}: {exc}") from None


# (stage, chunk, instruction, freq_mhz) -> (time_s, energy_j) per size (None: the reference size).
SizedRows = Mapping[tuple[int, int, str, int, MicrobatchSize | None], tuple[float, float]]


def split_by_size(rows: SizedRows, source: str, error: type[Exception]
                  ) -> tuple[dict[LengthKey, tuple[float, float]], MicrobatchSize | None, tuple[LengthSample, ...]]:
    """The profile's plain rows, its reference size and its samples at other sizes.

    The reference size is the largest size any row states (training packs micro-batches up to it, so the
    profiler measures it first); rows stating it and rows stating none are the plain rows (one per
    stage, chunk, instruction and clock: both at once is a duplicate), the others length samples.
    """
    sized = [size for (*_, size) in rows if size is not None]
    reference = max(sized) if sized else None
    plain: dict[LengthKey, tuple[float, float]] = {}
    samples = []
    for (stage, chunk, instruction, freq, size), (time_s, energy_j) in rows.items():
        key = (stage, chunk, instruction, freq)
        if size is None or size == reference:
            if key in plain:
                raise error(f"{source}: {_where(key)} is given both without a size and at the reference size "
                            f"{reference} (the largest in the file): remove one of them")
            plain[key] = (time_s, energy_j)
        else:
            samples.append(LengthSample(stage, chunk, instruction, freq, size, time_s, energy_j))
    # Every unit sampled at other sizes has rows at the reference size: stages that state different
    # sizes would otherwise become samples only, and a plan would cover the other stages alone.
    units = {(stage, chunk, instruction) for stage, chunk, instruction, _ in plain}
    orphan = sorted({(s.stage, s.chunk, s.instruction) for s in samples} - units)
    if orphan:
        stage, chunk, instruction = orphan[0]
        seen = sorted({s.size for s in samples if (s.stage, s.chunk, s.instruction) == orphan[0]})
        unit = f"stage {stage}{f' chunk {chunk}' if chunk else ''} {instruction}"
        raise error(f"{source}: {unit} states only the "
                    f"micro-batch size(s) {', '.join(map(str, seen))}, not the reference size {reference} (the "
                    f"largest in the file): every stage needs rows at the same reference size; profile the "
                    f"stages at one micro-batch size")
    for sample in samples:
        at_ref = plain.get(sample.key)  # (a clock measured at other sizes only: nothing to compare with)
        problem = reference is not None and at_ref is not None and _implausible(sample, *at_ref, reference)
        if problem:
            raise error(f"{source}: {problem}")
    return plain, reference, tuple(samples)

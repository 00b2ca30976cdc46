#!/usr/bin/env python3
"""Probe an NVIDIA GPU for EnvPipe: clocks, clock locking, clock-change latency,
and a transformer layer's time and energy per SM clock.

    python3 bench/gpu_probe.py                       # everything, device 0
    python3 bench/gpu_probe.py --list                # supported clocks only (no privileges needed)
    sudo -E python3 bench/gpu_probe.py --step 90 --reps 5 --out out/probe.csv

Steps (see docs/gpu-probe.md):

1. GPU, driver, CUDA, torch and date; the supported SM clocks (NVML, at the
   highest memory clock).
2. Lock check: first one trial lock (megatron-envpipe's start-up check): a refused
   lock exits with status 3, a lock accepted but not reached with status 4, in the
   first seconds, instead of profiling the default clock for minutes. Then lock a
   low and the maximum clock under load, read back the SM clock NVML reports, reset.
3. Clock-change latency as the kernels see it: a steady stream of fixed-size
   matmuls (or ``torch.cuda._sleep`` spin kernels), each timed with CUDA events;
   NVML is asked to change the clock while the stream runs; the latency is the
   GPU time from the kernel running at the request to the first kernel whose
   duration shifted to the new level (resolution: one kernel, ~1 ms).
4. Profile: ``torch.nn.TransformerEncoderLayer`` forward and backward (bf16 where
   supported, fixed batch) at every ``--step`` MHz from the maximum (always
   included); per clock ``--reps`` repetitions; time from CUDA events, energy
   from NVML's cumulative counter over windows of repeated units at least
   ``--min-window-s`` long (the counter moves in steps, ~100 ms on A100). Written as a
   Perseus-format CSV (``stage,instruction,frequency,time,energy``, stage 0,
   seconds and joules per unit), readable by ``envpipe plan --profile``.

Clocks are locked through megatron-envpipe's ClockGuard: they are reset at the
end, on exceptions, on Ctrl-C and on SIGTERM; after a SIGKILL run
``envpipe reset-clocks``. Without a GPU it exits with status 2 and one line.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import math
import platform
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout works without installing

from megatron_envpipe.core.gpu_specs import spec_for_nvml_name  # noqa: E402
from megatron_envpipe.core.profile import Profile, ProfileError  # noqa: E402
from megatron_envpipe.gpu.base import PERMISSION_HINT, GpuError  # noqa: E402
from megatron_envpipe.gpu.clock_proof import ProofOutcome, cuda_spin_load, prove_clock_control  # noqa: E402
from megatron_envpipe.gpu.nvml import NvmlGpu, nvml_acquire, nvml_release  # noqa: E402
from megatron_envpipe.gpu.safety import ClockGuard  # noqa: E402


def fail(message: str, status: int = 2) -> None:
    print(f"gpu_probe: {message}", file=sys.stderr, flush=True)
    raise SystemExit(status)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", type=int, default=0, help="local CUDA device index (default 0)")
    p.add_argument("--list", action="store_true", help="only print the GPU and its supported clocks")
    p.add_argument("--skip-latency", action="store_true", help="skip the clock-change latency measurement")
    p.add_argument("--skip-profile", action="store_true", help="skip the transformer-layer profile")
    p.add_argument("--step", type=int, default=90, help="profile every STEP MHz down from the maximum (default 90)")
    p.add_argument("--min-mhz", type=int, default=None,
                   help="lowest clock to profile (default: the GPU table's minimum, else half the maximum)")
    p.add_argument("--reps", type=int, default=5, help="repetitions per clock (default 5)")
    p.add_argument("--min-window-s", type=float, default=0.5,
                   help="shortest energy window; units are repeated to fill it (default 0.5 s)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kernel", choices=("matmul", "sleep"), default="matmul",
                   help="probe kernel for the latency test (default matmul)")
    p.add_argument("--kernel-ms", type=float, default=1.0, help="target probe-kernel duration at f_max (ms)")
    p.add_argument("--kernels", type=int, default=1000, help="probe kernels per latency measurement")
    p.add_argument("--latency-reps", type=int, default=3)
    p.add_argument("--state-dir", default=None, help="ClockGuard state directory (default: $ENVPIPE_STATE_DIR or "
                                                     "/var/lib/megatron-envpipe/locked-clocks)")
    p.add_argument("--out", default=None, help="profile CSV (default out/gpu_probe_<gpu>.csv)")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def pick_clocks(supported: tuple[int, ...], step: int, floor: int) -> list[int]:
    """Max, then the supported clock nearest to max - k*step, down to ``floor``."""
    out = [supported[0]]
    target = supported[0] - step
    while target >= floor:
        nearest = min(supported, key=lambda c: abs(c - target))
        if nearest >= floor and nearest not in out:
            out.append(nearest)
        target -= step
    return out


def first_incomplete(events: list, start: int = 0) -> int:
    for i in range(start, len(events)):
        if not events[i].query():
            return i
    return len(events)


class ProbeKernel:
    """A fixed-size unit of GPU work whose duration scales with the SM clock."""

    def __init__(self, torch, kind: str, target_ms: float, f_max: int, dtype) -> None:
        self.torch = torch
        self.kind = kind
        self.ms = target_ms
        if kind == "sleep":
            self.cycles = int(target_ms * 1e-3 * f_max * 1e6)
            self.describe = f"torch.cuda._sleep({self.cycles}) spin kernel"
            return
        for n in (1024, 2048, 4096, 6144, 8192, 12288, 16384):
            self.a = torch.randn(n, n, device="cuda", dtype=dtype)
            self.b = torch.randn(n, n, device="cuda", dtype=dtype)
            self.c = torch.empty(n, n, device="cuda", dtype=dtype)
            self.ms = self.time_ms()
            if self.ms >= target_ms:
                break
        self.describe = f"{n}x{n} {str(dtype).replace('torch.', '')} matmul"

    def __call__(self) -> None:
        if self.kind == "sleep":
            self.torch.cuda._sleep(self.cycles)
        else:
            self.torch.mm(self.a, self.b, out=self.c)

    def time_ms(self, reps: int = 10) -> float:
        torch = self.torch
        self()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(reps):
            self()
        e.record()
        e.synchronize()
        return s.elapsed_time(e) / reps


def busy_clock(torch, gpu: NvmlGpu, kernel: ProbeKernel, ms: float = 200.0) -> int | None:
    """SM clock NVML reports while the GPU is busy."""
    per = max(kernel.time_ms(3), 1e-3)
    for _ in range(int(ms / per) + 1):
        kernel()
    time.sleep(ms / 2000.0)
    f = gpu.current_sm_clock_mhz()
    torch.cuda.synchronize()
    return f


# ---------------------------------------------------------------------------
# 2. lock check, 3. latency
# ---------------------------------------------------------------------------


def prove_or_fail(gpu, guard, load) -> None:
    """One trial lock, read back, reset; exits (3 refused, 4 not reached) with one line."""
    try:
        proof = prove_clock_control(gpu, guard, load=load)
    except GpuError as exc:  # not a refusal: e.g. the state folder cannot be written
        fail(f"the trial lock failed: {exc}")
    if proof.outcome == ProofOutcome.REFUSED:
        fail(f"cannot lock clocks: {proof.message}; {PERMISSION_HINT}", status=3)
    if proof.outcome == ProofOutcome.NOT_REACHED:
        fail(f"clock lock not reached, so a profile would not measure the clocks it names: {proof.message}",
             status=4)
    print(f"lock    {proof.message}", flush=True)


def lock_check(torch, gpu, guard, clocks, kernel) -> None:
    low = min(clocks, key=lambda c: abs(c - clocks[0] * 0.6))
    print("\n== lock check (SM clock NVML reports under load)")
    for f in (low, clocks[0]):
        guard.lock(gpu, f)
        seen = busy_clock(torch, gpu, kernel)
        flag = "ok" if seen is not None and abs(seen - f) <= 30 else "DIFFERS (power/thermal capping? another tool?)"
        print(f"  locked {f:5d} MHz -> running at {seen} MHz   {flag}")
    guard.reset(gpu)
    print(f"  reset            -> running at {busy_clock(torch, gpu, kernel)} MHz (driver default)")


def one_switch(torch, gpu, guard, kernel, f_from: int, f_to: int, n: int, settle_ms: float = 500.0) -> dict:
    guard.lock(gpu, f_from)
    for _ in range(int(settle_ms / max(kernel.ms, 1e-3)) + 1):  # let the previous change land first
        kernel()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    base = torch.cuda.Event(enable_timing=True)
    base.record()
    for i in range(n):
        starts[i].record()
        kernel()
        ends[i].record()
    # launching may have blocked on a full queue; request once the stream is steady
    target = min(first_incomplete(ends) + 30, n - 1)
    while not ends[target].query():
        pass
    j_req = first_incomplete(ends, target)
    t0 = time.perf_counter()
    guard.lock(gpu, f_to)
    call_ms = (time.perf_counter() - t0) * 1e3
    j_after = first_incomplete(ends, j_req)
    torch.cuda.synchronize()
    dur = [starts[i].elapsed_time(ends[i]) for i in range(n)]
    at = [base.elapsed_time(starts[i]) for i in range(n)]
    before = statistics.median(dur[max(0, j_req - 20):j_req] or dur[:1])
    after = statistics.median(dur[-20:])
    backlog_ms = at[-1] + dur[-1] - at[min(j_req, n - 1)]
    result = {"from": f_from, "to": f_to, "call_ms": call_ms, "kernel_before_ms": before,
              "kernel_after_ms": after, "backlog_ms": backlog_ms, "latency_ms": None,
              "resolution_ms": dur[min(j_req, n - 1)], "during_call_kernels": j_after - j_req}
    if j_req >= n or abs(after - before) < 0.05 * before:
        return result  # the stream ran out, or no visible change
    mid = (before + after) / 2
    slower = after > before
    for k in range(j_req, n - 2):
        if all((dur[k + i] > mid) == slower for i in range(3)):
            result["latency_ms"] = at[k] - at[j_req]
            break
    return result


def latency(torch, gpu, guard, clocks, kernel, args) -> None:
    low = min(clocks, key=lambda c: abs(c - clocks[0] * 0.6))
    print(f"\n== clock-change latency as seen by kernels ({kernel.describe}, {args.kernels} per run)")
    for f_from, f_to in ((clocks[0], low), (low, clocks[0])):
        runs = [one_switch(torch, gpu, guard, kernel, f_from, f_to, args.kernels) for _ in range(args.latency_reps)]
        lat = [r["latency_ms"] for r in runs if r["latency_ms"] is not None]
        r0 = runs[0]
        print(f"  {f_from:5d} -> {f_to:5d} MHz: kernel {r0['kernel_before_ms']:.3f} -> {r0['kernel_after_ms']:.3f} ms; "
              f"NVML call {statistics.median(r['call_ms'] for r in runs):.2f} ms (host)")
        if lat:
            print(f"      latency to the first shifted kernel: median {statistics.median(lat):.1f} ms "
                  f"(runs: {', '.join(f'{v:.1f}' for v in lat)}; resolution +-{r0['resolution_ms']:.2f} ms)")
        missing = len(runs) - len(lat)
        if missing:
            print(f"      {missing} run(s) saw no shift within the {r0['backlog_ms']:.0f} ms of queued kernels: "
                  "the latency is longer, or the clock did not change (see the lock check)")
    guard.reset(gpu)


# ---------------------------------------------------------------------------
# 4. transformer-layer profile
# ---------------------------------------------------------------------------


def measure_window(torch, gpu, k: int, body) -> tuple[float, list[float], int]:
    """Run ``body`` k times between two energy reads; (joules per unit, event times s, busy SM clock)."""
    torch.cuda.synchronize()
    e0 = gpu.energy_mj()
    times = [body() for _ in range(k)]
    clock = gpu.current_sm_clock_mhz()  # read while the queued work runs
    torch.cuda.synchronize()
    e1 = gpu.energy_mj()
    return (e1 - e0) / 1000.0 / k, [s.elapsed_time(e) / 1000.0 for s, e in times], clock


def profile(torch, gpu, guard, clocks, args, dtype):
    dev = torch.device("cuda", args.device)
    layer = torch.nn.TransformerEncoderLayer(
        d_model=args.hidden, nhead=args.heads, dim_feedforward=4 * args.hidden, dropout=0.0,
        batch_first=True, device=dev, dtype=dtype,
    ).train()
    x = torch.randn(args.batch, args.seq, args.hidden, device=dev, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)
    holder: dict = {}
    ev = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731

    def forward():
        s, e = ev(), ev()
        s.record()
        holder["y"] = layer(x)
        e.record()
        return s, e

    def forward_backward():
        y = layer(x)
        s, e = ev(), ev()
        s.record()
        y.backward(grad)
        e.record()
        return s, e

    print(f"\n== profile: TransformerEncoderLayer(d_model={args.hidden}, nhead={args.heads}, ffn={4 * args.hidden}), "
          f"batch {args.batch} x seq {args.seq}, {str(dtype).replace('torch.', '')}, {args.reps} reps per clock")
    print(f"  {'MHz':>5} {'seen':>5} {'F ms':>8} {'F J':>8} {'B ms':>8} {'B J':>8} {'F+B W':>7}  windows")
    rows = []
    for f in clocks:
        guard.lock(gpu, f)
        for _ in range(3):
            forward_backward()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(3):
            forward_backward()
        torch.cuda.synchronize()
        per_fb = (time.perf_counter() - t) / 3
        k_f = max(5, math.ceil(args.min_window_s / max(per_fb / 3, 1e-6)))
        k_fb = max(5, math.ceil(args.min_window_s / max(per_fb, 1e-6)))
        f_t, f_e, b_t, b_e, seen = [], [], [], [], []
        for _ in range(args.reps):
            ef, tf, c1 = measure_window(torch, gpu, k_f, forward)
            holder.clear()
            efb, tb, c2 = measure_window(torch, gpu, k_fb, forward_backward)
            f_t.append(statistics.fmean(tf))
            f_e.append(ef)
            b_t.append(statistics.fmean(tb))
            b_e.append(efb - ef)
            seen += [c for c in (c1, c2) if c is not None]
        row = {"frequency": f, "forward_time": statistics.fmean(f_t), "forward_energy": statistics.fmean(f_e),
               "backward_time": statistics.fmean(b_t), "backward_energy": statistics.fmean(b_e)}
        rows.append(row)
        busy = row["forward_time"] + row["backward_time"]
        power = (row["forward_energy"] + row["backward_energy"]) / busy if busy > 0 else float("nan")
        print(f"  {f:5d} {int(statistics.median(seen)) if seen else 0:5d} {1e3 * row['forward_time']:8.3f} {row['forward_energy']:8.3f} "
              f"{1e3 * row['backward_time']:8.3f} {row['backward_energy']:8.3f} {power:7.1f}  {k_f}F/{k_fb}FB x{args.reps}",
              flush=True)
    guard.reset(gpu)
    return rows


def write_csv(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["stage", "instruction", "frequency", "time", "energy"])
        for r in rows:
            w.writerow([0, "forward", r["frequency"], repr(r["forward_time"]), repr(r["forward_energy"])])
            w.writerow([0, "backward", r["frequency"], repr(r["backward_time"]), repr(r["backward_energy"])])


# ---------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:  # NVML first: without a driver this is instant and needs no torch
        nvml_release(nvml_acquire())
    except GpuError as exc:
        fail(f"no NVIDIA GPU usable here: {exc}")
    try:
        import torch
    except ImportError:
        fail("needs torch with CUDA: pip install torch (a CUDA build)")
    if not torch.cuda.is_available():
        fail("no NVIDIA GPU visible to torch (torch.cuda.is_available() is False: a CPU build of torch, "
             "or CUDA_VISIBLE_DEVICES hides the GPUs)")
    if not 0 <= args.device < torch.cuda.device_count():
        fail(f"--device {args.device}: torch sees {torch.cuda.device_count()} GPU(s)")
    torch.cuda.set_device(args.device)

    gpu = NvmlGpu.for_torch_device(args.device)
    info = gpu.info()
    clocks = gpu.supported_clocks_mhz()
    dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    print(f"GPU     {info.name}  {info.uuid}  PCI {info.pci_bus_id}  (CUDA device {args.device}: {gpu.origin})")
    print(f"driver  {info.driver_version}   CUDA {torch.version.cuda}   torch {torch.__version__}   "
          f"python {platform.python_version()}")
    print(f"host    {socket.gethostname()}   date {now}")
    print(f"power   {gpu.power_w():.1f} W now;  energy counter {gpu.energy_mj() / 1000:.1f} J")
    print(f"clocks  {len(clocks)} supported SM clocks, {clocks[0]}..{clocks[-1]} MHz:")
    print("        " + " ".join(str(c) for c in clocks))
    if args.list:
        gpu.close()
        return 0

    floor = args.min_mhz
    if floor is None:
        try:
            spec = spec_for_nvml_name(info.name)
        except Exception:
            spec = None
        floor = spec.min_clock_mhz if spec is not None and spec.min_clock_mhz > clocks[0] // 3 else clocks[0] // 2
    targets = pick_clocks(clocks, args.step, floor)
    guard = ClockGuard(args.state_dir)
    try:
        prove_or_fail(gpu, guard, cuda_spin_load())  # seconds, before minutes of profiling
        kernel = ProbeKernel(torch, args.kernel, args.kernel_ms, clocks[0], dtype)
        lock_check(torch, gpu, guard, clocks, kernel)
        if not args.skip_latency:
            latency(torch, gpu, guard, clocks, kernel, args)
        if not args.skip_profile:
            rows = profile(torch, gpu, guard, targets, args, dtype)
            slug = "".join(ch if ch.isalnum() else "-" for ch in info.name.lower()).strip("-")
            out = Path(args.out or f"out/gpu_probe_{slug}.csv")
            write_csv(out, rows)
            print(f"\nwrote {out} ({len(rows)} clocks x forward/backward, Perseus format)")
            try:
                Profile.from_csv(out)  # what envpipe plan will read
            except ProfileError as exc:
                print(f"WARNING: envpipe would reject it: {exc} (longer --min-window-s or more --reps?)")
    finally:
        guard.close()  # resets the clocks whatever happened
        gpu.close()
    print("clocks reset to the driver default")
    return 0


if __name__ == "__main__":
    sys.exit(main())

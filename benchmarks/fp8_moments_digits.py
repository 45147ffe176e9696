"""Would 8-bit AdamW moments change what a model learns? CPU, real data; a probe, not a mode.

The engine's leanest update (bf16 weights rounded stochastically, bf16 moments, no fp32 main
weights: `--no-fp32-main-weights`) moves 14 bytes a parameter, and on one H200 that update is
a quarter of a Unified-IO 2 `paper` b4 step. Moments in 8 bits would move 10. This probe asks
the numerical question first, on the tiny CLIP trained on scikit-learn's handwritten digits
(zero-shot accuracy on the held-out split, as benchmarks/bf16_moments_digits.py), before any
engine code changes:

- the engine's update (RoundedWeightsAdamW, bf16 moments);
- the first moment and the square root of the second (half the binades of the second) in
  float8 e4m3, each with a scale per block of `--block` elements (the block's largest value
  maps to e4m3's largest, 448), rounded stochastically on 8 bits of the moments' own draw;
  a root that rounds to zero is read as half the block's smallest step, so a weight whose
  second moment underflowed moves by at most what its first allows, not by m / eps;
- the same rounded to nearest, which shows whether the stochastic rounding is what keeps
  the moments moving (e4m3 holds 3 mantissa bits: one step of the second moment, 0.1% of it,
  is far below half a unit);
- the first moment alone in e4m3 (it forgets its rounding in tens of steps, beta1 = 0.9),
  the second in bf16: 12 bytes a parameter.

And, without a model, the moments alone over thousands of steps of a synthetic gradient
stream (`drift`): how far each kind's update direction strays from fp32 moments'.

The 8-bit update is eager Python here (a weight at a time): its speed is not the question.

    PYTHONPATH=src python benchmarks/fp8_moments_digits.py --out benchmarks/results/DIR
"""

from __future__ import annotations

import datetime
import json
import platform
import statistics

import torch
import torch.nn.functional as F

from bf16_moments_digits import TAIL, digits_arguments, run  # this folder is on sys.path
from mosaic.engine import trainer
from mosaic.engine.fp8_first_moment import FP8_TOP, SUBNORMAL_STEP, fp8_stochastic
from mosaic.engine.main_weights import hashed_bits, stochastic_bf16
from mosaic.engine.rounded_weights import RoundedWeightsAdamW, bf16_weights_adamw, weight_bits

LEAN = {"bf16_weights": True, "bf16_moments": True, "fp32_main_weights": False}
BETAS, EPS = (0.9, 0.999), 1e-8
KINDS = ("fp32", "bf16", "fp8 stochastic", "fp8 nearest", "fp8 first moment and bf16 second")
"""How a probe keeps AdamW's moments: fp32; bf16 (the engine's); the first moment and the
root of the second in block-scaled e4m3, rounded stochastically or to nearest; or the first
in e4m3 (stochastic) and the second in bf16 as the engine keeps it."""


def fp8_rounded(x: torch.Tensor, bits8: torch.Tensor | None) -> torch.Tensor:
    """`x` (within ±448) to e4m3: to nearest when `bits8` is None, else stochastically on
    those 8 random bits as the engine rounds (fp8_first_moment.fp8_stochastic)."""
    return x.to(torch.float8_e4m3fn) if bits8 is None else fp8_stochastic(x, bits8)


def block_quantized(x: torch.Tensor, block: int, bits8: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat fp32 `x` (a multiple of `block` long) as e4m3 codes and a scale per block."""
    blocks = x.view(-1, block)
    scale = blocks.abs().amax(dim=1) / FP8_TOP  # 0 for a block of zeros
    noise = None if bits8 is None else bits8.view(-1, block)
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
    return fp8_rounded(blocks / divisor[:, None], noise).view(-1), scale


def dequantized(codes: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    return (codes.float().view(-1, block) * scale[:, None]).view(-1)


def dequantized_root(codes: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """The second moment's root, a code of zero in a block that holds more read as half the
    block's smallest step (a block of zeros, as before the first step, reads zero)."""
    root = dequantized(codes, scale, block).view(-1, block)
    floor = 0.5 * SUBNORMAL_STEP * scale[:, None]
    return torch.where(root > 0, root, floor).view(-1)


def zero_moments(kind: str, numel: int, block: int) -> dict:
    zeros = torch.zeros(-(-numel // block) * block)
    if kind == "fp32":
        return {"m": zeros, "root": zeros}
    if kind == "bf16":
        return {"m": zeros.bfloat16(), "v": zeros.bfloat16()}
    second = ({"v": zeros.bfloat16()} if kind.endswith("bf16 second")
              else {"root": block_quantized(zeros, block, None)})
    return {"m": block_quantized(zeros, block, None), **second}


def read_moments(kind: str, state: dict, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first moment and the root of the second, as stored."""
    m = state["m"].float() if kind in ("fp32", "bf16") else dequantized(*state["m"], block)
    if "v" in state:
        return m, state["v"].float().sqrt()
    return m, state["root"] if kind == "fp32" else dequantized_root(*state["root"], block)


def moments_step(kind: str, state: dict, g: torch.Tensor, bits: torch.Tensor, block: int
                 ) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """One step of AdamW's moments kept as `kind`: the state to store, and this step's first
    moment and root of the second in fp32 (what the update divides), from the stored ones."""
    beta1, beta2 = BETAS
    m_old, root_old = read_moments(kind, state, block)
    m = m_old + (g - m_old) * (1 - beta1)
    root = torch.sqrt(root_old * root_old * beta2 + g * g * (1 - beta2))
    if kind == "fp32":
        return {"m": m, "root": root}, m, root
    nearest = kind == "fp8 nearest"
    stored = {"m": stochastic_bf16(m, bits & 0xFFFF) if kind == "bf16"
              else block_quantized(m, block, None if nearest else bits & 0xFF)}
    if "v" in state:
        stored["v"] = stochastic_bf16(root * root, (bits >> 16) & 0xFFFF)
    else:
        stored["root"] = block_quantized(root, block, None if nearest else (bits >> 8) & 0xFF)
    return stored, m, root


class ProbeMomentsAdamW(RoundedWeightsAdamW):
    """RoundedWeightsAdamW whose bf16 weights' moments are kept as `kind` (KINDS), a weight
    at a time, eager, padded to whole blocks. Checkpoints and CUDA graphs are out of scope."""

    def __init__(self, params, lr: float, *, kind: str, block: int = 256, **kwargs) -> None:
        self.kind, self.block = kind, block  # _add_flat_state reads them
        super().__init__(params, lr, **kwargs)

    def _add_flat_state(self, run: list[torch.nn.Parameter]) -> None:
        for p in run:
            self.state[p] = {"step": self._step,
                             "moments": zero_moments(self.kind, p.numel(), self.block)}

    def _bf16_step(self) -> None:
        if self._found_inf.item():  # the trainer's guard found a non-finite gradient
            return
        group = self.param_groups[0]
        self._step += 1
        step_size = self._lr / (1 - BETAS[0] ** self._step)
        bias2_sqrt = torch.sqrt(1 - BETAS[1] ** self._step)
        for p in self.bf16:
            if p.grad is not None:
                self._update(p, step_size, bias2_sqrt, group["eps"], group["weight_decay"])

    def _update(self, p, step_size, bias2_sqrt, eps, weight_decay) -> None:
        state, n = self.state[p], p.numel()
        pad = -(-n // self.block) * self.block - n
        g = F.pad(p.grad.float().flatten() / self._grad_scale, (0, pad))
        main = F.pad(p.data.float().flatten(), (0, pad))
        bits = hashed_bits(g, self._step.to(torch.int32))
        state["moments"], m, root = moments_step(self.kind, state["moments"], g, bits,
                                                 self.block)
        new = main * (1 - self._lr * weight_decay) - step_size * m / (root / bias2_sqrt + eps)
        rounded = stochastic_bf16(new, weight_bits(new, self._step.to(torch.int32)))
        p.data.copy_(rounded[:n].view(p.shape))


def optimizer_of(kind: str, block: int):
    """The trainer's optimizer factory, its bf16 weights' moments kept as `kind` (bf16: the
    engine's own optimizer)."""
    if kind == "bf16":
        return bf16_weights_adamw

    def make(params, lr, *, weight_decay=0.0, moments="bf16", fp32_main_weights=True):
        return ProbeMomentsAdamW(params, lr, kind=kind, block=block,
                                 weight_decay=weight_decay, moments=moments)
    return make


def gradient_stream(numel: int):
    """Step t's gradient (a function of t): a fixed signal under heavy-tailed noise (Student
    t, 4 degrees), scaled per row of 1024 by a log-uniform factor over three decades and per
    column over one, as weight gradients are laid out in rows."""
    gen = torch.Generator().manual_seed(0)
    scale = (10 ** (-3 * torch.rand(numel // 1024, 1, generator=gen))
             * 10 ** (-torch.rand(1, 1024, generator=gen))).flatten()
    signal = torch.randn(numel, generator=gen) * 0.2
    student = torch.distributions.StudentT(4.0)

    def at(t: int) -> torch.Tensor:
        torch.manual_seed(t)
        return scale * (signal + student.sample((numel,)) / 2 ** 0.5)
    return at


def drift(steps: int, numel: int, block: int, checkpoints: tuple[int, ...]) -> dict:
    """The moments alone over a long run: AdamW's update direction m_hat / (sqrt(v_hat) + eps)
    from each kind of moments against fp32 moments fed the same gradients (gradient_stream):
    its relative L2 error, the median relative error of the root of the second moment, and
    the share of roots read as zero. The digits run is 240 steps, where beta2 = 0.999 has
    not yet averaged; this is what thousands do."""
    states = {kind: zero_moments(kind, numel, block) for kind in KINDS}
    gradient, out = gradient_stream(numel), {kind: [] for kind in KINDS[1:]}
    for t in range(1, steps + 1):
        g = gradient(t)
        bits = hashed_bits(g, torch.tensor(t, dtype=torch.int32))
        now = {}
        for kind in KINDS:
            states[kind], *now[kind] = moments_step(kind, states[kind], g, bits, block)
        if t in checkpoints:
            for kind in KINDS[1:]:
                out[kind].append({"step": t, **_against(now[kind], now["fp32"], t)})
    return out


def _against(moments, reference, t: int) -> dict:
    bias1, bias2 = 1 - BETAS[0] ** t, (1 - BETAS[1] ** t) ** 0.5
    update, exact = ((m / bias1) / (root / bias2 + EPS) for m, root in (moments, reference))
    root, exact_root = moments[1], reference[1]
    return {"update_relative_l2": float((update - exact).norm() / exact.norm()),
            "root_median_relative": float(((root - exact_root).abs() / exact_root).median()),
            "roots_at_zero": float((root == 0).float().mean())}


def main() -> None:
    parser = digits_arguments(__doc__.splitlines()[0])
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--kinds", default=",".join(KINDS[1:]),
                        help="comma-separated KINDS of moments to train the digits with")
    parser.add_argument("--drift-steps", type=int, default=3000,
                        help="steps of the moments-alone comparison (0: skip it)")
    parser.add_argument("--drift-numel", type=int, default=1 << 16)
    args = parser.parse_args()
    names = [name.strip() for name in args.kinds.split(",") if name.strip()]
    if unknown := sorted(set(names) - set(KINDS)):
        parser.error(f"--kinds {unknown}: use some of {list(KINDS)}")
    runs = {}
    for name in names:
        trainer.bf16_weights_adamw = optimizer_of(name, args.block)
        runs[name] = [run(LEAN, seed, args.steps, args.batch, args.lr)
                      for seed in range(args.seeds)]
    trainer.bf16_weights_adamw = bf16_weights_adamw
    checkpoints = tuple(t for t in (10, 100, 300, 1000, 3000, 10000) if t < args.drift_steps)
    moments = (drift(args.drift_steps, args.drift_numel, args.block,
                     (*checkpoints, args.drift_steps)) if args.drift_steps else {})
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "hardware": f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)",
              "torch": torch.__version__, "model": "clip", "preset": "tiny", "data": "digits",
              "steps": args.steps, "batch": args.batch, "lr": args.lr, "tail_steps": TAIL,
              "block": args.block,
              "runs": runs, "drift_numel": args.drift_numel, "drift": moments}
    (args.out / "fp8_moments_digits.json").write_text(json.dumps(record, indent=1))
    for name, rows in runs.items():
        accuracy = [r["zero_shot_accuracy"] for r in rows]
        print(f"{name}: zero-shot {statistics.fmean(accuracy):.3f} "
              f"(per seed {[round(a, 3) for a in accuracy]}), final loss "
              f"{statistics.fmean(r['final_loss'] for r in rows):.4f}")
    for name, points in moments.items():
        print(f"{name}: update direction's relative L2 error by step "
              + ", ".join(f"{p['step']}: {p['update_relative_l2']:.3f} (root "
                          f"{p['root_median_relative']:.3f}, zero {p['roots_at_zero']:.1e})"
                          for p in points))


if __name__ == "__main__":
    main()

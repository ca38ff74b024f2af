"""Math verification throughput: ``MathEnvironment.check`` and the shared ``MathVerifier``
(each with 2 worker processes and hard per-sample timeouts) against a plain single-process
loop over math-verify (``parse`` + ``verify`` with its default settings), side by side in
one run, on the same mixed workload; all three must agree on every verdict.

Workload: ``--pairs`` (ground truth, response) pairs, a fixed mix of fractions, decimals,
integers, polynomial identities, surds, intervals, wrong answers and unboxed answers, some
with a sentence of reasoning before the answer. Each repeat draws a fresh workload (same for
every method) and runs the methods in rotating order; the table shows median rates.

    .venv/bin/python benchmarks/math_verify_throughput.py [--pairs 800] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from math_verify import parse, verify

from envloop.environments.common.math_verification import MathVerifier
from envloop.environments.math_environment import MathEnvironment

Pair = tuple[str, str]
REASONING = [
    "",
    "Let me compute step by step. First simplify the expression, then evaluate it. ",
    "We have $x = 2y$ and $y = 3$, so substituting gives the result. Therefore ",
    "The answer is ",
]


def workload(n: int, seed: int) -> list[Pair]:
    rng = random.Random(seed)
    makers = [_fraction, _decimal, _integer, _polynomial, _surd, _wrong, _unboxed, _interval]
    pairs = []
    for i in range(n):
        truth, answer = makers[i % len(makers)](rng)
        pairs.append((truth, rng.choice(REASONING) + answer))
    return pairs


def _fraction(rng: random.Random) -> Pair:
    a, b, k = rng.randint(1, 50), rng.randint(2, 60), rng.randint(2, 5)
    return f"{a}/{b}", rf"$\boxed{{\frac{{{k * a}}}{{{k * b}}}}}$"


def _decimal(rng: random.Random) -> Pair:
    q = Fraction(rng.randint(1, 99), rng.choice([2, 4, 5, 8, 10, 20, 25]))
    return rf"\frac{{{q.numerator}}}{{{q.denominator}}}", rf"\boxed{{{float(q)}}}"


def _integer(rng: random.Random) -> Pair:
    v = rng.randint(-500, 5000)
    return str(v), rf"so the total is \boxed{{{v}}}."


def _polynomial(rng: random.Random) -> Pair:
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    return f"(x+{a})(x+{b})", rf"\boxed{{x^2+{a + b}x+{a * b}}}"


def _surd(rng: random.Random) -> Pair:
    n, k = rng.choice([2, 3, 5, 6, 7]), rng.randint(2, 9)
    return rf"{k}\sqrt{{{n}}}", rf"\boxed{{\sqrt{{{k * k * n}}}}}"


def _wrong(rng: random.Random) -> Pair:
    v = rng.randint(1, 1000)
    return str(v), rf"\boxed{{{v + rng.randint(1, 9)}}}"


def _unboxed(rng: random.Random) -> Pair:
    v = rng.randint(1, 100)
    return str(v), rng.choice([f"I think it is {v}.", "I am not sure.", f"The result: {v + 1}"])


def _interval(rng: random.Random) -> Pair:
    a, b = sorted(rng.sample(range(-20, 20), 2))
    return f"[{a}, {b})", rf"\boxed{{[{a},{b})}}"


def plain_loop(pairs: list[Pair]) -> list[bool]:
    verdicts = []
    for truth, answer in pairs:
        gold, predicted = parse(f"\\boxed{{{truth}}}"), parse(answer)
        verdicts.append(bool(gold and predicted and verify(gold, predicted)))
    return verdicts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=800)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()

    env = MathEnvironment({"num_workers": args.workers})
    verifier = MathVerifier(num_workers=args.workers)
    methods: dict[str, Callable[[list[Pair]], list[bool]]] = {
        "plain loop, 1 process": plain_loop,
        f"MathVerifier, {args.workers} workers": lambda p: [o.value for o in verifier.check(p)],
        f"MathEnvironment, {args.workers} workers": lambda p: [o.value for o in env.check(p)],
    }
    rates: dict[str, list[float]] = {name: [] for name in methods}
    try:
        for run in methods.values():  # warm-up: imports, lazy parsers
            run(workload(64, seed=10_000))
        for repeat in range(args.repeats):
            pairs = workload(args.pairs, seed=repeat)
            names = list(methods)[repeat % 3 :] + list(methods)[: repeat % 3]
            verdicts = {}
            for name in names:
                start = time.perf_counter()
                verdicts[name] = methods[name](pairs)
                rates[name].append(len(pairs) / (time.perf_counter() - start))
            if len({tuple(v) for v in verdicts.values()}) != 1:
                raise SystemExit("The methods disagree on some verdicts; the comparison is void.")
    finally:
        env.shutdown()
        verifier.close()

    base = statistics.median(rates["plain loop, 1 process"])
    print(
        f"\n{args.pairs} pairs x {args.repeats} repeats, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.2f}; median of repeats\n"
    )
    print("| method | verifications / s | vs plain loop | per repeat |")
    print("|---|---:|---:|---|")
    for name, values in rates.items():
        median = statistics.median(values)
        runs = ", ".join(f"{v:.0f}" for v in values)
        print(f"| {name} | {median:.0f} | {median / base:.2f}x | {runs} |")


if __name__ == "__main__":
    main()

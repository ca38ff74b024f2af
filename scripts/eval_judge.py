"""Held-out accuracy and calibration of the bundled judge against the exact verifier.

    .venv/bin/python scripts/eval_judge.py [--questions 100] [--samples 8] [--seed 0]

On held-out arithmetic questions (:func:`envloop.demo.tasks.math_items` with
``held_out=True``), the judge environment (``bundled:judge``, template
``reference_equivalence``) judges

- **pairs**: a right reply and a wrong one (:func:`tasks.wrong_response`) per question, with
  and without the reference answer, greedily: accuracy is the share of judgements that agree
  with the exact verifier (``math`` environment, math-verify);
- **policy replies**: one reply per question sampled from ``bundled:policy`` at temperature
  1 (what the demo's judge sees), greedily, and with ``--samples`` judgements at temperature
  1 whose mean is the judge's probability that the reply is right: the calibration table
  bins those probabilities and gives, per bin, how many replies and the share the verifier
  calls right, with the expected calibration error (ECE) and the Brier score;
- **pairs, calibrated**: the same table for the pairs' replies (half right, half wrong),
  without the reference;
- **groups** (``--groups N``): N held-out questions with three replies each (right, wrong, or
  cut short), judged together in group mode (template ``group_comparison``), with and
  without the reference: the share of replies whose score agrees with the verifier.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from envloop.demo import tasks
from envloop.environments.judge_environment import JudgeEnvironment
from envloop.environments.math_environment import MathEnvironment
from envloop.models.generation.hf_generation import HfGeneration


def conversation(question: str, reply: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": reply}]


def judge_scores(env: JudgeEnvironment, logs: list[Any], metadata: list[Any]) -> list[Any]:
    """Each sample's judge score (None: not judged)."""
    ret = env.step(logs, metadata)
    return [md.get("judge", {}).get("score") if md else None for md in ret.metadata]


def verified(verifier: MathEnvironment, replies: list[str], truths: list[str]) -> list[bool]:
    return [v.correct for v in verifier.judge(replies, truths)]


def policy_replies(questions: list[tasks.MathItem], seed: int) -> list[str]:
    """One reply per question from the bundled policy, sampled at temperature 1."""
    import torch

    from envloop.data.llm_message_utils import get_formatted_message_log
    from envloop.distributed.batched_data_dict import BatchedDataDict
    from envloop.environments.reward_model.batching import pad_sequences

    policy = HfGeneration({"model_name": "bundled:policy", "max_new_tokens": 48, "seed": seed})
    prompts = [
        get_formatted_message_log(
            [{"role": "user", "content": q.question}], policy.tokenizer, add_generation_prompt=True
        )[0]["token_ids"].tolist()
        for q in questions
    ]
    ids, _ = pad_sequences(prompts, policy.pad_id)
    data = BatchedDataDict(input_ids=ids, input_lengths=torch.tensor([len(p) for p in prompts]))
    out = policy.generate(data)
    texts = []
    for row, prompt in enumerate(prompts):
        tokens = out["output_ids"][row, len(prompt) : int(out["unpadded_sequence_lengths"][row])]
        texts.append(policy.tokenizer.decode(tokens, skip_special_tokens=True))
    policy.shutdown()
    return texts


def print_accuracy(
    env: JudgeEnvironment, logs: list[Any], truths: list[str], exact: list[bool]
) -> None:
    """Print the share of ``logs``' judgements that agree with the verifier (``exact``),
    with the reference answers (``truths``) and without."""
    for name, metadata in [("with reference", [{"ground_truth": t} for t in truths]),
                           ("without reference", [{} for _ in truths])]:  # fmt: skip
        scores = judge_scores(env, logs, metadata)
        agree = sum(s is not None and (s >= 0.5) == e for s, e in zip(scores, exact))
        unjudged = sum(s is None for s in scores)
        print(f"  {name}: accuracy {agree / len(scores):.3f} ({agree}/{len(scores)}), "
              f"not judged {unjudged}")  # fmt: skip


def group_accuracy(questions: list[tasks.MathItem], rng: random.Random, judge: dict) -> None:
    """Print group mode's accuracy on ``questions``, three replies each."""
    verifier = MathEnvironment({"num_workers": 1})
    env = JudgeEnvironment(
        {"judge": {**judge, "max_new_tokens": 128}, "mode": "group",
         "template": "group_comparison", "group_reward": "score"}
    )  # fmt: skip
    logs, truths, replies = [], [], []
    for q in questions:
        for _ in range(3):
            draw = rng.random()
            reply = (
                q.response() if draw < 0.45
                else tasks.wrong_response(q, rng) if draw < 0.9
                else q.response()[: rng.randint(0, q.response().index("\\boxed"))]
            )  # fmt: skip
            logs.append(conversation(q.question, reply))
            replies.append(reply)
            truths.append(q.ground_truth)
    exact = verified(verifier, replies, truths)
    print(f"held-out groups ({len(questions)} questions, 3 replies each, group mode):")
    print_accuracy(env, logs, truths, exact)
    env.shutdown()
    verifier.shutdown()


def calibration(probabilities: list[float], truths: list[bool], bins: int = 5) -> list[str]:
    """Markdown rows: per probability bin, replies, mean probability, share right; then the
    ECE and the Brier score."""
    rows, ece = [], 0.0
    for b in range(bins):
        low, high = b / bins, (b + 1) / bins
        members = [
            (p, t)
            for p, t in zip(probabilities, truths)
            if low <= p < high or (b == bins - 1 and p == 1.0)
        ]
        if not members:
            continue
        mean_p = sum(p for p, _ in members) / len(members)
        right = sum(t for _, t in members) / len(members)
        ece += len(members) / len(truths) * abs(mean_p - right)
        rows.append(f"| {low:.1f}-{high:.1f} | {len(members)} | {mean_p:.3f} | {right:.3f} |")
    brier = sum((p - t) ** 2 for p, t in zip(probabilities, truths)) / len(truths)
    return [*rows, f"\nECE {ece:.3f}, Brier {brier:.3f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--questions", type=int, default=100)
    parser.add_argument("--samples", type=int, default=8, help="0: pairs only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--judge", default="bundled:judge")
    parser.add_argument("--groups", type=int, default=0, help="questions judged in group mode")
    args = parser.parse_args()
    started = time.monotonic()
    rng = random.Random(args.seed)
    questions = rng.sample(tasks.math_items(held_out=True), args.questions)
    verifier = MathEnvironment({"num_workers": 1})
    judge = {"model_name": args.judge, "max_new_tokens": 64}
    if args.groups:
        group_accuracy(rng.sample(tasks.math_items(held_out=True), args.groups), rng, judge)
    greedy = JudgeEnvironment({"judge": judge})

    print(f"held-out pairs ({args.questions} questions, right and wrong reply each):")
    right = [q.response() for q in questions]
    wrong = [tasks.wrong_response(q, rng) for q in questions]
    replies = right + wrong
    truths = [q.ground_truth for q in questions] * 2
    exact = verified(verifier, replies, truths)
    pair_logs = [conversation(q.question, r) for q, r in zip(questions * 2, replies)]
    print_accuracy(greedy, pair_logs, truths, exact)

    if args.samples == 0:  # pairs only
        greedy.shutdown()
        verifier.shutdown()
        return
    print("bundled policy's replies (T=1), without reference:")
    sampled = policy_replies(questions, args.seed)
    exact = verified(verifier, sampled, [q.ground_truth for q in questions])
    logs = [conversation(q.question, r) for q, r in zip(questions, sampled)]
    scores = judge_scores(greedy, logs, [{}] * len(logs))
    agree = sum(s is not None and (s >= 0.5) == e for s, e in zip(scores, exact))
    print(f"  verifier: {sum(exact)}/{len(exact)} right; greedy judge agrees on {agree}")
    sampler = JudgeEnvironment(
        {"judge": {**judge, "seed": args.seed}, "greedy": False, "num_judgements": args.samples}
    )
    probabilities = [
        s if s is not None else 0.0 for s in judge_scores(sampler, logs, [{}] * len(logs))
    ]
    print(f"  calibration ({args.samples} judgements at T=1 each):")
    print("| judge P(right) | replies | mean P | verifier: right |\n|---|---|---|---|")
    print("\n".join(calibration(probabilities, exact)))
    print(f"held-out pairs, without reference: calibration ({args.samples} judgements at T=1):")
    pair_truths = verified(verifier, replies, truths)
    probabilities = [
        s if s is not None else 0.0 for s in judge_scores(sampler, pair_logs, [{}] * len(replies))
    ]
    print("| judge P(right) | replies | mean P | verifier: right |\n|---|---|---|---|")
    print("\n".join(calibration(probabilities, pair_truths)))
    for env in (greedy, sampler, verifier):
        env.shutdown()
    print(f"done in {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()

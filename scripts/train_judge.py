"""Train the bundled judge (``envloop/demo/assets/judge``) on CPU, reproducibly.

    nice -n 19 .venv/bin/python scripts/train_judge.py [--steps 2000] [--batch-size 16]
        [--lr 3e-3] [--seed 0] [--kinds single_ref=0.3,single=0.7] [--out DIR] [--init DIR]

The shipped weights are two runs (see docs/judge.md for the held-out accuracy and
calibration): the defaults (``--out DIR``; 14 minutes on a shared 2-core machine), then 600
steps from those weights with group prompts added,

    nice -n 19 .venv/bin/python scripts/train_judge.py --init DIR --steps 600 \
        --kinds single_ref=0.15,single=0.35,group_ref=0.2,group=0.3

(10 minutes), which keeps the single-reply accuracy and adds ``group_comparison``.

The judge is the bundled policy (a 4-layer Qwen3 causal LM, 0.85 M parameters, that works
the demo's arithmetic column by column) fine-tuned to answer the judge environment's
built-in prompts (:mod:`envloop.environments.judge.templates`) about the demo's arithmetic
replies (:mod:`envloop.demo.tasks`). It writes both numbers zero-padded to one width, then
their digits side by side with ``=`` (same) or ``!`` (different), then the verdict, so that
each step follows from the few tokens just before it:

- ``reference_equivalence`` with a reference answer (kind ``single_ref``):
  ``reference 085; reply 086: 00= 88= 56! no``;
- the same without one (``single``): it works the question first,
  ``7 + 8 = 15, 3 + 4 + 1 = 8, so 085; reply 086: 00= 88= 56! no``;
- ``group_comparison`` (``group_ref``, ``group``; 2-3 replies; in the second run only): the
  same first part, then one line per reply, ``1: reply 086: 00= 88= 56! no``.

``reply`` is the reply's last boxed number (``none`` when it has none: ``reply none: no``).
Replies are right (:meth:`MathItem.response`), wrong (:func:`tasks.wrong_response`: a column
off by one, or a wrong boxed number) or cut short before their answer. Prompts are rendered
and tokenized exactly as the judge environment does (the template, then the chat template
with the generation prompt); the loss covers the judge's reply and its EOS, each verdict's
deciding token (``y`` of `` yes``, ``n`` of `` no``) weighted ``--verdict-weight``. Training
questions only: the held-out tenth (:func:`tasks.is_held_out`) is what the held-out rates
printed during training, and ``scripts/eval_judge.py``, measure. Same seed, same weights
(on the same torch build).
"""

from __future__ import annotations

import argparse
import functools
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from envloop.demo import ASSETS, tasks
from envloop.environments.common.answer_extraction import extract_boxed
from envloop.environments.judge.templates import JudgeTemplate, load_template, template_variables
from envloop.environments.reward_model.batching import pad_sequences

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo_training import train

KINDS = {"single_ref": 0.3, "single": 0.7, "group_ref": 0.0, "group": 0.0}
"""The share of training steps spent on each kind of judge prompt (``--kinds``)."""

Example = tuple[list[int], list[float], list[bool]]
"""Token ids [T], loss weights [T], and whether each token is a verdict's deciding one [T]."""


def steps_of(item: tasks.MathItem) -> str:
    """The worked columns of a right reply, without its boxed answer."""
    return item.response().rsplit(", so ", 1)[0]


def reply_number(reply: str) -> str:
    return extract_boxed(reply) or "none"


def replies(item: tasks.MathItem, rng: random.Random, count: int) -> list[tuple[str, bool]]:
    """``count`` replies to ``item`` with whether each is right: right, wrong or cut short
    (before its answer), 40/50/10."""
    out = []
    for _ in range(count):
        draw = rng.random()
        if draw < 0.4:
            out.append((item.response(), True))
        elif draw < 0.9:
            out.append((tasks.wrong_response(item, rng), False))
        else:
            full = item.response()
            out.append((full[: rng.randint(0, full.index("\\boxed"))], False))
    return out


def padded(number: str, width: int) -> str:
    return number.zfill(width) if number.isdigit() else number


def comparison(head: str, value: str, reply: str) -> str:
    """``<head> <value>; reply <number>: <pairs> <verdict>``: both numbers left-padded with
    zeros to one width (at least 3 digits), then their digits side by side, one pair per
    place with ``=`` (same) or ``!`` (different), then ``yes`` or ``no``.

    >>> comparison("reference", "85", "so \\\\boxed{86}")
    'reference 085; reply 086: 00= 88= 56! no'
    >>> comparison("reference", "85", "7 + 8 = 15")
    'reference 085; reply none: no'
    """
    number = reply_number(reply)
    if not number.isdigit():
        return f"{head} {padded(value, 3)}; reply {number}: no"
    width = max(3, len(value), len(number))
    a, b = padded(value, width), padded(number, width)
    pairs = " ".join(f"{x}{y}{'=' if x == y else '!'}" for x, y in zip(a, b))
    return f"{head} {a}; reply {b}: {pairs} {'yes' if a == b else 'no'}"


def judge_example(
    item: tasks.MathItem, group: list[tuple[str, bool]], with_reference: bool, grouped: bool
) -> tuple[str, str, dict[str, Any]]:
    """``(template name, judge reply, template variables)`` of one judge prompt."""
    messages = [{"role": "user", "content": item.question}]
    metadata = {"ground_truth": item.ground_truth} if with_reference else {}
    head = "reference" if with_reference else f"{steps_of(item)}, so"
    value = item.ground_truth
    if not grouped:
        reply = group[0][0]
        messages.append({"role": "assistant", "content": reply})
        verdict = comparison(head, value, reply)
        return "reference_equivalence", verdict, template_variables(messages, metadata)
    first = f"{head} {padded(value, 3)}"
    lines = [
        f"{k}: {comparison('', value, reply).split('; ', 1)[1]}"
        for k, (reply, _) in enumerate(group, 1)
    ]
    variables = template_variables(messages, metadata, [reply for reply, _ in group])
    return "group_comparison", "\n".join([first, *lines]), variables


@functools.cache
def template(name: str) -> JudgeTemplate:
    return load_template(name)


def encode(
    tokenizer: Any, name: str, variables: dict[str, Any], reply: str, verdict_weight: float
) -> Example:
    """The prompt as the judge environment builds it, then the judge's reply and its EOS:
    ids, loss weights (0 on the prompt, 1 on the reply, ``verdict_weight`` on each verdict's
    deciding token) and the verdict flags."""
    messages = [{"role": "user", "content": template(name).render(variables)}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    reply_ids = tokenizer(reply, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    pieces = tokenizer.convert_ids_to_tokens(reply_ids)
    verdicts = [k >= 1 and p in ("y", "n") and pieces[k - 1] == "Ġ" for k, p in enumerate(pieces)]
    weights = [verdict_weight if v else 1.0 for v in verdicts]
    n = len(prompt_ids)
    return prompt_ids + reply_ids, [0.0] * n + weights, [False] * n + verdicts


def example(
    tokenizer: Any, kind: str, item: tasks.MathItem, rng: random.Random, verdict_weight: float
) -> Example:
    grouped = kind.startswith("group")
    group = replies(item, rng, rng.randint(2, 3) if grouped else 1)
    name, reply, variables = judge_example(item, group, kind.endswith("_ref"), grouped)
    return encode(tokenizer, name, variables, reply, verdict_weight)


def batches(
    tokenizer: Any,
    items: list[tasks.MathItem],
    rng: random.Random,
    batch_size: int,
    kinds: dict[str, float],
    verdict_weight: float,
) -> Iterator[tuple[str, list[Example]]]:
    """Endless batches, each of one kind, kinds drawn with the weights ``kinds``."""
    names, weights = list(kinds), list(kinds.values())
    while True:
        kind = rng.choices(names, weights)[0]
        yield (
            kind,
            [
                example(tokenizer, kind, rng.choice(items), rng, verdict_weight)
                for _ in range(batch_size)
            ],
        )


def tensors(batch: list[Example], pad_id: int, device: str) -> tuple[torch.Tensor, ...]:
    """``input_ids``, ``attention_mask``, loss weights and verdict flags, each [b, L]."""
    ids, attention = pad_sequences([i for i, _, _ in batch], pad_id)
    longest = ids.shape[1]
    weights = torch.tensor([w + [0.0] * (longest - len(w)) for _, w, _ in batch])
    verdicts = torch.tensor([v + [False] * (longest - len(v)) for _, _, v in batch])
    return ids.to(device), attention.to(device), weights.to(device), verdicts.to(device)


def loss_of(model: Any, batch: list[Example], pad_id: int, device: str) -> torch.Tensor:
    ids, attention, weights, _ = tensors(batch, pad_id, device)
    logits = model(input_ids=ids, attention_mask=attention, use_cache=False).logits[:, :-1]
    losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
    return (losses * weights[:, 1:]).sum() / weights[:, 1:].sum()  # weighted mean, reply tokens


@torch.no_grad()
def held_out_rates(
    model: Any, batch: list[Example], pad_id: int, device: str
) -> tuple[float, float]:
    """``(exact, verdict)``: the share of examples whose every reply token is the model's
    argmax given the ones before it (what greedy decoding writes), and the share of verdict
    tokens that are the argmax given the right reply before them."""
    model.eval()
    ids, attention, weights, verdicts = tensors(batch, pad_id, device)
    predicted = model(input_ids=ids, attention_mask=attention, use_cache=False).logits.argmax(-1)
    hit = predicted[:, :-1] == ids[:, 1:]
    wrong = (~hit & (weights[:, 1:] > 0)).any(dim=1)
    verdict_hits = hit[verdicts[:, 1:]]
    model.train()
    return 1.0 - wrong.float().mean().item(), verdict_hits.float().mean().item()


def parse_kinds(text: str) -> dict[str, float]:
    kinds = {}
    for part in text.split(","):
        name, _, share = part.partition("=")
        if name not in KINDS or not share:
            raise SystemExit(f"--kinds: {part!r}: expected KIND=SHARE with KIND in {list(KINDS)}")
        kinds[name] = float(share)
    return kinds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--verdict-weight", type=float, default=1.0)
    parser.add_argument(
        "--kinds", type=parse_kinds, default=KINDS, help="e.g. single_ref=0.5,single=0.5"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: shared CPUs)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--eval-every", type=int, default=200)
    parser.add_argument("--policy", type=Path, default=ASSETS / "policy")
    parser.add_argument(
        "--init", type=Path, default=None, help="start from this judge instead of the policy"
    )
    parser.add_argument("--out", type=Path, default=ASSETS / "judge")
    args = parser.parse_args()
    started = time.monotonic()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.policy)
    model = AutoModelForCausalLM.from_pretrained(args.init or args.policy, dtype=torch.float32)
    model.to(args.device)
    pad_id, weight = tokenizer.pad_token_id, args.verdict_weight
    rng = random.Random(args.seed)
    held_rng = random.Random(args.seed + 1)
    held_items = tasks.math_items(True)
    held_out = {
        kind: [example(tokenizer, kind, held_rng.choice(held_items), held_rng, weight)
               for _ in range(128)]
        for kind, share in args.kinds.items() if share > 0
    }  # fmt: skip

    def on_log(step: int, losses: dict[str, float]) -> None:
        text = " ".join(f"{k} {v:.3f}" for k, v in sorted(losses.items()))
        if step % args.eval_every == 0 or step == args.steps:
            rates = {k: held_out_rates(model, b, pad_id, args.device) for k, b in held_out.items()}
            text += " | held-out exact/verdict " + " ".join(
                f"{k} {e:.2f}/{v:.2f}" for k, (e, v) in rates.items()
            )
        print(f"step {step} {time.monotonic() - started:.0f}s {text}", flush=True)

    stream = batches(
        tokenizer, tasks.math_items(held_out=False), rng, args.batch_size, args.kinds, weight
    )
    train(
        model, stream, args.steps, args.lr,
        lambda b: loss_of(model, b, pad_id, args.device), on_log,
    )  # fmt: skip
    model.to("cpu")
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(args.out)
    model.save_pretrained(args.out)
    print(f"saved to {args.out} after {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()

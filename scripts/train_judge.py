"""Train the bundled judge (``envloop/demo/assets/judge``) on CPU, reproducibly.

    .venv/bin/python scripts/train_judge.py [--steps 600] [--batch-size 16] [--seed 0]
        [--out DIR] [--init DIR] [--verdict-weight 1]

The shipped weights are the defaults' (600 steps of 16 examples; 44 minutes on a shared
2-core machine): they do not judge yet (held-out accuracy at chance; see docs/judge.md).

The judge is the bundled policy (a 4-layer Qwen3 causal LM, 0.85 M parameters, that works
the demo's arithmetic column by column) fine-tuned to answer the judge environment's
built-in prompts (:mod:`envloop.environments.judge.templates`) about the demo's arithmetic
replies (:mod:`envloop.demo.tasks`):

- ``reference_equivalence`` with a reference answer: ``reference 85; reply 86: no``;
- the same without one: it works the question first,
  ``7 + 8 = 15, 3 + 4 + 1 = 8, so 85; reply 86: no``;
- ``group_comparison`` (2-3 replies, with or without a reference): the same first part,
  then one line per reply, ``1: reply 85, yes``.

``reply`` is the reply's last boxed number (``none`` when it has none). Replies are right
(:meth:`MathItem.response`), wrong (:func:`tasks.wrong_response`: a column off by one, or a
wrong boxed number) or cut short before their answer. Prompts are rendered and tokenized
exactly as the judge environment does (the template, then the chat template with the
generation prompt); the loss covers the judge's reply and its EOS. Training questions only:
the held-out tenth (:func:`tasks.is_held_out`) is what the accuracy printed at the end, and
``scripts/eval_judge.py``, measure. Same seed, same weights (on the same torch build).
"""

from __future__ import annotations

import argparse
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
from envloop.environments.judge.templates import load_template, template_variables
from envloop.environments.reward_model.batching import pad_sequences

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo_training import train

KINDS = {"single_ref": 0.3, "single": 0.4, "group_ref": 0.1, "group": 0.2}
"""The share of training steps spent on each kind of judge prompt."""


def steps_of(item: tasks.MathItem) -> str:
    """The worked columns of a right reply, without its boxed answer."""
    return item.response().rsplit(", so ", 1)[0]


def reply_number(reply: str) -> str:
    return extract_boxed(reply) or "none"


def replies(item: tasks.MathItem, rng: random.Random, count: int) -> list[tuple[str, bool]]:
    """``count`` replies to ``item`` with whether each is right: right, wrong or cut short
    (before its answer), about 45/45/10."""
    out = []
    for _ in range(count):
        draw = rng.random()
        if draw < 0.45:
            out.append((item.response(), True))
        elif draw < 0.9:
            out.append((tasks.wrong_response(item, rng), False))
        else:
            full = item.response()
            out.append((full[: rng.randint(0, full.index("\\boxed"))], False))
    return out


def judge_example(
    item: tasks.MathItem, group: list[tuple[str, bool]], with_reference: bool, grouped: bool
) -> tuple[str, str, dict[str, Any]]:
    """``(template name, judge reply, template variables)`` of one judge prompt."""
    messages = [{"role": "user", "content": item.question}]
    metadata = {"ground_truth": item.ground_truth} if with_reference else {}
    head = f"reference {item.value}" if with_reference else f"{steps_of(item)}, so {item.value}"
    if not grouped:
        reply, right = group[0]
        messages.append({"role": "assistant", "content": reply})
        verdict = f"{head}; reply {reply_number(reply)}: {'yes' if right else 'no'}"
        return "reference_equivalence", verdict, template_variables(messages, metadata)
    lines = [
        f"{k}: reply {reply_number(reply)}, {'yes' if right else 'no'}"
        for k, (reply, right) in enumerate(group, 1)
    ]
    variables = template_variables(messages, metadata, [reply for reply, _ in group])
    return "group_comparison", "\n".join([head, *lines]), variables


VERDICT_WEIGHT = 1
"""Loss weight of a verdict's deciding token (``y`` of `` yes``, ``n`` of `` no``; one token
per judgement decides it, against dozens copied or worked out); ``--verdict-weight`` sets
it (the shipped weights: 1)."""


def encode(tokenizer: Any, template: str, variables: dict[str, Any], reply: str) -> Any:
    """Token ids [T] and loss weights [T] (0 on the prompt, 1 on the judge's reply and its
    EOS, :data:`VERDICT_WEIGHT` on each verdict's deciding token): the prompt as the judge
    environment builds it."""
    prompt = load_template(template).render(variables)
    messages = [{"role": "user", "content": prompt}]
    ids = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer(ids, add_special_tokens=False)["input_ids"]
    reply_ids = tokenizer(reply, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    pieces = tokenizer.convert_ids_to_tokens(reply_ids)
    weights = [
        VERDICT_WEIGHT if k >= 2 and p in ("y", "n") and pieces[k - 1] == "Ġ" else 1
        for k, p in enumerate(pieces)
    ]
    return prompt_ids + reply_ids, [0] * len(prompt_ids) + weights


def example(tokenizer: Any, kind: str, item: tasks.MathItem, rng: random.Random) -> Any:
    grouped = kind.startswith("group")
    group = replies(item, rng, rng.randint(2, 3) if grouped else 1)
    template, reply, variables = judge_example(item, group, kind.endswith("_ref"), grouped)
    return encode(tokenizer, template, variables, reply)


def batches(
    tokenizer: Any, items: list[tasks.MathItem], rng: random.Random, batch_size: int
) -> Iterator[tuple[str, Any]]:
    """Endless batches, each of one kind, kinds drawn with the weights of :data:`KINDS`."""
    kinds, weights = list(KINDS), list(KINDS.values())
    while True:
        kind = rng.choices(kinds, weights)[0]
        yield kind, [example(tokenizer, kind, rng.choice(items), rng) for _ in range(batch_size)]


def loss_of(model: Any, batch: list[Any], pad_id: int) -> torch.Tensor:
    ids, attention = pad_sequences([i for i, _ in batch], pad_id)
    mask, _ = pad_sequences([m for _, m in batch], 0)
    logits = model(input_ids=ids, attention_mask=attention, use_cache=False).logits[:, :-1]
    targets, weights = ids[:, 1:], mask[:, 1:].float()
    losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    return (losses * weights).sum() / weights.sum()  # a weighted mean over reply tokens


@torch.no_grad()
def exact_match(model: Any, batch: list[Any], pad_id: int) -> float:
    """Fraction of examples whose every reply token is the model's argmax given the ones
    before it (exactly what greedy decoding would write)."""
    model.eval()
    ids, attention = pad_sequences([i for i, _ in batch], pad_id)
    mask, _ = pad_sequences([m for _, m in batch], 0)
    predicted = model(input_ids=ids, attention_mask=attention, use_cache=False).logits.argmax(-1)
    wrong = ((predicted[:, :-1] != ids[:, 1:]) & (mask[:, 1:] > 0)).any(dim=1)
    model.train()
    return 1.0 - wrong.float().mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--verdict-weight", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: shared CPUs)")
    parser.add_argument("--policy", type=Path, default=ASSETS / "policy")
    parser.add_argument(
        "--init", type=Path, default=None, help="start from this judge instead of the policy"
    )
    parser.add_argument("--out", type=Path, default=ASSETS / "judge")
    args = parser.parse_args()
    started = time.monotonic()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    global VERDICT_WEIGHT
    VERDICT_WEIGHT = args.verdict_weight
    tokenizer = AutoTokenizer.from_pretrained(args.policy)
    model = AutoModelForCausalLM.from_pretrained(args.init or args.policy, dtype=torch.float32)
    pad_id = tokenizer.pad_token_id
    rng = random.Random(args.seed)
    held_rng = random.Random(args.seed + 1)
    held_out = {
        kind: [example(tokenizer, kind, held_rng.choice(tasks.math_items(True)), held_rng)
               for _ in range(64)]
        for kind in KINDS
    }  # fmt: skip

    def on_log(step: int, losses: dict[str, float]) -> None:
        text = " ".join(f"{k} {v:.3f}" for k, v in sorted(losses.items()))
        if step % 300 == 0 or step == args.steps:
            matches = {k: exact_match(model, b, pad_id) for k, b in held_out.items()}
            text += " | held-out exact " + " ".join(f"{k} {v:.2f}" for k, v in matches.items())
        print(f"step {step} {time.monotonic() - started:.0f}s {text}", flush=True)

    stream = batches(tokenizer, tasks.math_items(held_out=False), rng, args.batch_size)
    train(model, stream, args.steps, args.lr, lambda b: loss_of(model, b, pad_id), on_log)
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(args.out)
    model.save_pretrained(args.out)
    print(f"saved to {args.out} after {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()

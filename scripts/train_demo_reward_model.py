"""Train the bundled demo reward model (``envloop/demo/assets/reward_model``) on CPU.

    .venv/bin/python scripts/train_demo_reward_model.py [--steps 6000] [--seed 0] [--out DIR]

The reward model is a one-label Qwen3 sequence classifier built on the bundled policy: the
policy's embeddings and layers, frozen, then ``--extra-layers`` new layers, the final norm
and the score head, trained. The policy already works arithmetic column by column, so its
last hidden state at every token predicts the right next token; the new layers learn to
notice a written token that disagrees with that prediction (a slip) and to carry the news to
the last token, where the score is read. It learns to score a right reply to an arithmetic
question of :mod:`envloop.demo.tasks` above a wrong one (:func:`tasks.wrong_response`: a
column off by one, or a wrong boxed number).

The loss is Bradley-Terry on the final scores, ``-log sigmoid(score(right) - score(wrong))``,
plus a dense logistic term: the score head, applied at every token of a reply, learns
whether the reply is still right up to that token (a process reward), so a slip is flagged
where it happens. A single end-of-reply bit per pair was too weak a signal to learn from in
minutes; fine-tuning the whole policy instead of adding layers learned far slower. Right
replies score above 0 and wrong ones below.

The frozen part's states are computed once and cached, so each step runs only the new
layers. Conversations are templated exactly as ``RewardModelEnvironment`` templates them
(the chat template without a generation prompt, tokenized without special tokens); the
environment reads the score at the last token. Same seed, same weights (same torch build).
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    Qwen3ForSequenceClassification,
)

from envloop.demo import ASSETS, tasks
from envloop.environments.reward_model.batching import pad_sequences


class Chat:
    """A one-turn chat: token ids [T], where its reply starts, and how many of its tokens
    agree with a right reply (T for a right one); ``states`` [T, H] are the frozen part's."""

    def __init__(self, ids: list[int], start: int, agree: int) -> None:
        self.ids, self.start, self.agree = ids, start, agree
        self.states = torch.empty(0)


Pair = tuple[Chat, Chat]  # (right, wrong)


def encode(tokenizer: Any, question: str, reply: str) -> list[int]:
    """Token ids of a one-turn chat, as ``RewardModelEnvironment.encode`` makes them."""
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": reply}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def reply_start(tokenizer: Any, question: str) -> int:
    """How many tokens of a chat come before the reply: the prompt and assistant header."""
    user = [{"role": "user", "content": question}]
    text = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def make_pairs(tokenizer: Any, items: list[tasks.MathItem], seed: int) -> list[Pair]:
    """One (right, wrong) pair of chats per question."""
    rng, out = random.Random(seed), []
    for item in items:
        right = encode(tokenizer, item.question, item.response())
        wrong = encode(tokenizer, item.question, tasks.wrong_response(item, rng))
        start = reply_start(tokenizer, item.question)
        agree = next(i for i, (x, y) in enumerate(zip(right, wrong)) if x != y)
        out.append((Chat(right, start, len(right)), Chat(wrong, start, agree)))
    return out


@torch.no_grad()
def cache_states(trunk: Any, chats: list[Chat], pad_id: int, batch: int = 512) -> None:
    """Each chat's hidden states after the frozen layers (before any norm)."""
    for i in range(0, len(chats), batch):
        part = chats[i : i + batch]
        ids, mask = pad_sequences([chat.ids for chat in part], pad_id)
        states = trunk(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        for chat, row in zip(part, states):
            chat.states = row[: len(chat.ids)].clone()


def token_scores(head: Any, chats: list[Chat]) -> torch.Tensor:
    """The score at every token [N, L] of ``chats``, from their cached states."""
    states = pad_sequence([chat.states for chat in chats], batch_first=True)
    _, mask = pad_sequences([chat.ids for chat in chats], 0)
    hidden = head.model(inputs_embeds=states, attention_mask=mask, use_cache=False)
    return head.score(hidden.last_hidden_state)[..., 0]


def final_scores(per_token: torch.Tensor, chats: list[Chat]) -> torch.Tensor:
    return per_token[torch.arange(len(chats)), torch.tensor([len(c.ids) - 1 for c in chats])]


def pair_loss(head: Any, batch: list[Pair]) -> torch.Tensor:
    """Bradley-Terry loss on the final scores plus the per-token logistic loss."""
    chats = [right for right, _ in batch] + [wrong for _, wrong in batch]
    per_token = token_scores(head, chats)
    final = final_scores(per_token, chats)
    bradley_terry = -torch.nn.functional.logsigmoid(final[: len(batch)] - final[len(batch) :])
    logits = torch.cat([per_token[i, c.start : len(c.ids)] for i, c in enumerate(chats)])
    targets = torch.cat([(torch.arange(c.start, len(c.ids)) < c.agree).float() for c in chats])
    dense = torch.nn.functional.binary_cross_entropy_with_logits(logits, targets)
    return bradley_terry.mean() + dense


@torch.no_grad()
def accuracy(head: Any, pairs: list[Pair]) -> tuple[float, float]:
    """Fraction of pairs scored right above wrong, and of replies on the right side of 0."""
    head.eval()
    chats = [c for pair in pairs for c in pair]
    scores = torch.cat(
        [final_scores(token_scores(head, chats[i : i + 512]), chats[i : i + 512])
         for i in range(0, len(chats), 512)]
    ).view(-1, 2)  # fmt: skip
    head.train()
    sides = ((scores[:, 0] > 0).float().mean() + (scores[:, 1] < 0).float().mean()) / 2
    return float((scores[:, 0] > scores[:, 1]).float().mean()), float(sides)


def build(policy: Path, extra_layers: int, seed: int) -> tuple[Any, Any, Any]:
    """The reward model (frozen policy layers, new ones on top), the frozen part as a model
    of its own (no final norm) and the new part as a model fed by the frozen part's states.
    The three share their parameter tensors."""
    config = AutoConfig.from_pretrained(policy)
    frozen = config.num_hidden_layers
    config.num_hidden_layers = frozen + extra_layers
    config.layer_types = ["full_attention"] * config.num_hidden_layers
    config.num_labels, config.architectures = 1, None
    torch.manual_seed(seed)
    model = Qwen3ForSequenceClassification(config)
    trunk = AutoModelForCausalLM.from_pretrained(policy).model
    weights = trunk.state_dict()
    model.model.load_state_dict({k: v for k, v in weights.items() if k != "norm.weight"}, False)
    with torch.no_grad():  # the first new layer reads the states as the policy's head did
        model.model.layers[frozen].input_layernorm.weight.copy_(weights["norm.weight"])
    trunk.layers = model.model.layers[:frozen]
    trunk.embed_tokens, trunk.norm = model.model.embed_tokens, torch.nn.Identity()
    head_config = AutoConfig.from_pretrained(policy)
    head_config.num_hidden_layers = extra_layers
    head_config.layer_types = ["full_attention"] * extra_layers
    head_config.num_labels = 1
    head = Qwen3ForSequenceClassification(head_config)
    head.model.layers, head.model.norm = model.model.layers[frozen:], model.model.norm
    head.model.embed_tokens, head.score = None, model.score
    for parameter in trunk.parameters():
        parameter.requires_grad_(False)
    return model, trunk.eval(), head


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=6e-3)
    parser.add_argument("--batch-size", type=int, default=32, help="pairs per step")
    parser.add_argument("--extra-layers", type=int, default=2)
    parser.add_argument("--policy", type=Path, default=ASSETS / "policy")
    parser.add_argument("--out", type=Path, default=ASSETS / "reward_model")
    args = parser.parse_args()
    started = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(args.policy)
    model, trunk, head = build(args.policy, args.extra_layers, args.seed)
    train_pairs = make_pairs(tokenizer, tasks.math_items(held_out=False), args.seed)
    held_out = make_pairs(tokenizer, tasks.math_items(held_out=True), args.seed + 1)
    for pairs in (train_pairs, held_out):
        cache_states(trunk, [c for pair in pairs for c in pair], tokenizer.pad_token_id)
    print(f"states cached in {time.monotonic() - started:.0f} s", flush=True)
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / 50) * max(0.05, 1 - step / args.steps)
    )
    rng, order = random.Random(args.seed), []  # type: random.Random, list[int]
    head.train()
    for step in range(args.steps):
        if len(order) < args.batch_size:
            order = rng.sample(range(len(train_pairs)), len(train_pairs))
        loss = pair_loss(head, [train_pairs[order.pop()] for _ in range(args.batch_size)])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % 100 == 0 or step + 1 == args.steps:
            extra = ""
            if (step + 1) % 500 == 0 or step + 1 == args.steps:
                pairwise, sides = accuracy(head, held_out)
                extra = f" | held-out pairwise {pairwise:.3f}, sign {sides:.3f}"
            elapsed = time.monotonic() - started
            print(f"step {step + 1} {elapsed:.0f}s loss {loss.item():.3f}{extra}", flush=True)
    model.config.pad_token_id = tokenizer.pad_token_id
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(args.out)
    model.eval().save_pretrained(args.out)
    print(f"saved to {args.out} after {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()

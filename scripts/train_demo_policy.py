"""Train the bundled demo policy (``envloop/demo/assets/policy``) on CPU, reproducibly.

    .venv/bin/python scripts/train_demo_policy.py [--steps 1800] [--seed 0] [--out DIR]
        [--save-at STEP DIR ...]

A 4-layer Qwen3 causal LM (hidden 128, 0.85 M parameters) with its own byte-level BPE
tokenizer (digits one per token, ChatML template) learns, by supervised training on the
synthetic conversations of :mod:`envloop.demo.tasks`, to

- answer ``What is 37 + 48?`` column by column,
  ``7 + 8 = 15, 3 + 4 + 1 = 8, so \\boxed{85}``, and EOS;
- answer again after ``Environment: incorrect`` (the wrong first answer is not trained on);
- play 2x2 and 3x3 sliding puzzles one ``<action>...</action>`` per turn, imitating a
  shortest solution; some episodes take a random detour first (not trained on), so the
  policy also knows its way back from boards off the shortest path.

Every training sequence is token for token what the rollout engine builds at demo time: the
prompt from ``get_formatted_message_log(..., add_generation_prompt=True)``, each response's
own tokens (plus EOS where generation ends at EOS; an action ends at the stop string
``</action>``), and each observation from ``ObservationRenderer`` (observation format
``chat_template``). The loss covers assistant tokens only, and the ``<|im_end|>`` that
follows an action (so a first turn without stop strings ends there too, giving the same
tokens). Same seed, same data, same weights (on the same torch build).

``--save-at STEP DIR`` (repeatable, STEP a multiple of 100) saves the model as it is after
STEP steps of the same ``--steps`` schedule (an earlier checkpoint on the bundled policy's
own training path, e.g. ``--save-at 300 DIR``: ``--steps 300`` would decay the learning rate
over 300 steps instead and give other weights); the run stops at the last STEP given.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from envloop.data.chat_templates import ObservationRenderer
from envloop.data.llm_message_utils import get_formatted_message_log
from envloop.data.tokenization import tokenize_texts
from envloop.demo import ASSETS, tasks
from envloop.environments.games.sliding_puzzle import SlidingPuzzleEnv, initial_prompt
from envloop.environments.games.sliding_puzzle_board import legal_moves
from envloop.environments.reward_model.batching import pad_sequences
from envloop.models.tiny import train_chatml_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo_training import train

CORRECT, INCORRECT = "Environment: correct", "Environment: incorrect"
MATH_ROLE, PUZZLE_ROLE = "environment", "user"  # the roles of the environments' observations
MAX_LEN = 512


@dataclass
class Turn:
    """One assistant reply and the observation that follows it (None: the episode ended)."""

    response: str
    train: bool  # the loss covers this reply
    eos: bool  # generation ends at EOS (math); else at a stop string (puzzle actions)
    observation: tuple[str, str] | None = None  # (role, content)


@dataclass
class Conversation:
    prompt: str  # the first user message
    turns: list[Turn]


# --- the synthetic conversations --------------------------------------------------------


def math_conversation(item: tasks.MathItem, rng: random.Random, retry: bool) -> Conversation:
    """A question answered right at once, or (``retry``) wrongly, then right after feedback."""
    if not retry:
        return Conversation(item.question, [Turn(item.response(), True, True)])
    wrong = Turn(tasks.wrong_response(item, rng), False, True, (MATH_ROLE, INCORRECT))
    return Conversation(item.question, [wrong, Turn(item.response(), True, True)])


def puzzle_conversation(
    env: SlidingPuzzleEnv, episode: dict[str, Any], rng: random.Random, detour: bool
) -> Conversation:
    """An episode played by the real environment: optimal moves (trained on), after one or
    two random legal moves first when ``detour`` (not trained on)."""
    detours = rng.randint(1, 2) if detour else 0
    prompt, turns = initial_prompt(episode), []
    while True:
        board = episode["board"]
        move = rng.choice(legal_moves(board)) if detours else tasks.optimal_moves(board)[0]
        turn = Turn(f"<action>{move}</action>", not detours, False)
        detours = max(detours - 1, 0)
        ret = env.step([[{"role": "assistant", "content": turn.response}]], [episode])
        episode = ret.metadata[0]
        turns.append(turn)
        if bool(ret.terminateds[0]):
            return Conversation(prompt, turns)
        turn.observation = (PUZZLE_ROLE, ret.observations[0]["content"])


# --- tokenizer and encoding -------------------------------------------------------------


def corpus_texts(conversations: list[Conversation]) -> list[str]:
    """The texts the tokenizer learns its merges from: each message as ``role\\ncontent``,
    as the template writes it, without the special tokens."""
    texts = []
    for conv in conversations:
        texts.append(f"user\n{conv.prompt}")
        for turn in conv.turns:
            texts.append(f"assistant\n{turn.response}")
            if turn.observation:
                texts.append("\n".join(turn.observation))
    return texts


def encode(
    conv: Conversation, tokenizer: Any, renderer: ObservationRenderer
) -> tuple[list[int], list[int]]:
    """Token ids [T] and loss mask [T] (1 on trained assistant tokens) of ``conv``."""
    prompt = get_formatted_message_log(
        [{"role": "user", "content": conv.prompt}], tokenizer, add_generation_prompt=True
    )
    ids = prompt[0]["token_ids"].tolist()
    mask = [0] * len(ids)
    pieces = []
    for turn in conv.turns:
        pieces.append(turn.response)
        if turn.observation:
            role, content = turn.observation
            pieces.append(renderer.render(role, content, response_ended_with_eos=turn.eos))
    encoded = iter(tokenize_texts(tokenizer, pieces))
    eos = tokenizer.eos_token_id
    for turn in conv.turns:
        reply = next(encoded) + ([eos] if turn.eos else [])
        ids += reply
        mask += [int(turn.train)] * len(reply)
        after = next(encoded) if turn.observation else [eos]
        # An action stops at "</action>": the <|im_end|> that follows belongs to the
        # observation, but the policy learns it so it also ends a turn without stop strings.
        ends_action = not turn.eos and after[:1] == [eos]
        if turn.observation or ends_action:
            ids += after
            mask += [int(turn.train and ends_action)] + [0] * (len(after) - 1)
    return ids[:MAX_LEN], mask[:MAX_LEN]


# --- training data ----------------------------------------------------------------------

Example = tuple[list[int], list[int]]  # token ids [T], loss mask [T]
KINDS = {"math": 0.4, "retry": 0.1, "puzzle2": 0.15, "puzzle3": 0.35}
"""The share of training steps spent on each kind of conversation."""


def training_conversations(seed: int, num_puzzles: int) -> dict[str, list[Conversation]]:
    """Every training question once (plain and as a retry), and ``num_puzzles`` episodes per
    puzzle size (seeds below ``tasks.HELD_OUT_SEED``, scrambles of 1-6 moves, varied move
    limits, a quarter with a detour)."""
    rng, env = random.Random(seed), SlidingPuzzleEnv()
    items = tasks.math_items(held_out=False)
    convs: dict[str, list[Conversation]] = {
        "math": [math_conversation(item, rng, retry=False) for item in items],
        "retry": [math_conversation(item, rng, retry=True) for item in items],
    }
    for size in (2, 3):
        convs[f"puzzle{size}"] = [
            puzzle_conversation(
                env,
                tasks.puzzle_episode(i, size, rng.randint(1, 6), rng.choice([6, 8, 10, 12])),
                rng,
                detour=rng.random() < 0.25,
            )
            for i in range(num_puzzles)
        ]
    return convs


def batches(
    pools: dict[str, list[Example]], rng: random.Random, tokens_per_batch: int
) -> Iterator[tuple[str, list[Example]]]:
    """Endless batches, each of one kind (similar lengths, little padding), kinds drawn with
    the weights of :data:`KINDS`, examples drawn without replacement until a pool runs out."""
    orders = {kind: [] for kind in pools}  # type: dict[str, list[int]]
    kinds, weights = list(KINDS), list(KINDS.values())
    while True:
        kind = rng.choices(kinds, weights)[0]
        pool, chosen, longest = pools[kind], [], 0
        while True:
            if not orders[kind]:
                orders[kind] = rng.sample(range(len(pool)), len(pool))
            example = pool[orders[kind][-1]]
            longest = max(longest, len(example[0]))
            if chosen and longest * (len(chosen) + 1) > tokens_per_batch:
                break
            chosen.append(pool[orders[kind].pop()])
        yield kind, chosen


def collate(examples: list[Example], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, L] and loss mask [B, L]. Causal attention never looks right, so
    padding on the right needs no attention mask."""
    ids, _ = pad_sequences([tokens for tokens, _ in examples], pad_id)
    loss_mask, _ = pad_sequences([mask for _, mask in examples], 0)
    return ids, loss_mask.bool()


# --- model and training -----------------------------------------------------------------


def build_model(tokenizer: Any, hidden: int, layers: int, seed: int) -> Any:
    """A Qwen3 causal LM (head dim 32, tied embeddings) sized for the demo."""
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,
        num_key_value_heads=hidden // 64,
        head_dim=32,
        max_position_embeddings=MAX_LEN,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config)


def masked_loss(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over the tokens where ``mask`` [B, L] is set."""
    hidden = model.model(input_ids=ids).last_hidden_state[:, :-1]
    targets = mask[:, 1:]
    logits = model.lm_head(hidden[targets])
    return torch.nn.functional.cross_entropy(logits, ids[:, 1:][targets])


# --- quick held-out check (teacher forced: exact match here == greedy decoding) ---------


@torch.no_grad()
def exact_match(model: Any, examples: list[Example], pad_id: int) -> float:
    """Fraction of ``examples`` whose every trained token is the model's argmax; that is
    exactly when greedy decoding reproduces the trained replies."""
    hits = 0
    for start in range(0, len(examples), 256):
        ids, mask = collate(examples[start : start + 256], pad_id)
        predicted = model(input_ids=ids).logits[:, :-1].argmax(-1)
        wrong = (predicted != ids[:, 1:]) & mask[:, 1:]
        hits += int((~wrong.any(-1)).sum())
    return hits / max(len(examples), 1)


def held_out_examples(tokenizer: Any, renderer: ObservationRenderer) -> dict[str, list[Example]]:
    """Held-out questions (plain) and puzzles (optimal play) as examples."""
    rng, env = random.Random(12345), SlidingPuzzleEnv()
    items = tasks.math_items(held_out=True)
    out = {"math": [encode(math_conversation(i, rng, False), tokenizer, renderer) for i in items]}
    for size in (2, 3):
        episodes = [
            tasks.puzzle_episode(tasks.HELD_OUT_SEED + i, size, tasks.PUZZLE_SHUFFLES[i % 3])
            for i in range(60)
        ]
        out[f"puzzle{size}"] = [
            encode(puzzle_conversation(env, e, rng, False), tokenizer, renderer) for e in episodes
        ]
    return out


# --- saving ----------------------------------------------------------------------------


class LastCheckpointSaved(Exception):
    """Raised from the log callback once the last ``--save-at`` checkpoint is written."""


def checkpoint_steps(save_at: list[list[str]], steps: int) -> dict[int, Path]:
    """``--save-at`` pairs as {step: folder}; each step a multiple of 100 (the log
    callback's period) within ``steps``."""
    checkpoints = {int(step): Path(folder) for step, folder in save_at}
    bad = [step for step in checkpoints if step % 100 or not 0 < step <= steps]
    if bad:
        raise SystemExit(f"--save-at steps must be multiples of 100 up to --steps {steps}: {bad}")
    return checkpoints


def save(model: Any, tokenizer: Any, folder: Path) -> None:
    """The model and tokenizer as a ``from_pretrained`` folder that generates up to EOS."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(folder)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1800)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--tokens-per-batch", type=int, default=4096)
    parser.add_argument("--puzzles", type=int, default=2000, help="episodes per puzzle size")
    parser.add_argument("--out", type=Path, default=ASSETS / "policy")
    parser.add_argument(
        "--save-at", nargs=2, action="append", default=[], metavar=("STEP", "DIR"),
        help="also save the model after STEP steps (a multiple of 100) to DIR; repeatable; "
        "the run stops at the last STEP",
    )  # fmt: skip
    args = parser.parse_args()
    save_at = checkpoint_steps(args.save_at, args.steps)
    started = time.monotonic()
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    convs = training_conversations(args.seed, args.puzzles)
    texts = corpus_texts([c for cs in convs.values() for c in cs])
    tokenizer = train_chatml_tokenizer(texts, args.vocab_size, digits_apart=True)
    renderer = ObservationRenderer(tokenizer)
    pools = {kind: [encode(c, tokenizer, renderer) for c in cs] for kind, cs in convs.items()}
    held_out = held_out_examples(tokenizer, renderer)
    print(
        f"data ready in {time.monotonic() - started:.0f} s: "
        + ", ".join(f"{k} {len(v)}" for k, v in pools.items()),
        flush=True,
    )
    model = build_model(tokenizer, args.hidden, args.layers, args.seed)
    pad = tokenizer.pad_token_id

    def log(step: int, losses: dict[str, float]) -> None:
        shown = " ".join(f"{k} {v:.3f}" for k, v in sorted(losses.items()))
        extra = ""
        if step % 300 == 0 or step == args.steps:
            model.eval()
            extra = " | held-out " + " ".join(
                f"{k} {exact_match(model, v, pad):.3f}" for k, v in held_out.items()
            )
            model.train()
        print(f"step {step} {time.monotonic() - started:.0f}s loss {shown}{extra}", flush=True)
        if step in save_at:
            save(model, tokenizer, save_at[step])
            print(f"saved step {step} to {save_at[step]}", flush=True)
            if step == max(save_at):
                raise LastCheckpointSaved

    stream = batches(pools, random.Random(args.seed + 1), args.tokens_per_batch)

    def loss_of(examples: list[Example]) -> torch.Tensor:
        return masked_loss(model, *collate(examples, pad))

    try:
        train(model, stream, args.steps, args.lr, loss_of, log)
    except LastCheckpointSaved:
        print(f"stopped after step {max(save_at)}, {time.monotonic() - started:.0f} s")
        return
    save(model, tokenizer, args.out)
    print(f"saved to {args.out} after {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()

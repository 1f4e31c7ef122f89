#!/usr/bin/env python
"""Train the project's embedded default model: a tiny character-level llama
that adds two integers.

Task format (one example, no BOS):

    "123+45=" -> "168" </s>

Operands have 1 to 3 digits (0..999), so sums go up to 1998. The answer is
written most-significant digit first, exactly as a person would read it.

The script is self-contained: it builds the tokenizer with the `tokenizers`
library, builds an `mlx_lm.models.llama.Model`, trains it with MLX on the CPU,
saves an mlx-lm compatible folder (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json, ...) and finally reloads the folder with
`mlx_lm.load` and measures greedy exact-match accuracy with
`mlx_lm.generate.generate_step` on held-out problems.

Usage:

    python scripts/train_adder.py --out models/adder --steps 3200 --seed 0

Training is deterministic given --seed (and the other hyper-parameters) on a
given machine and BLAS. Two things keep it inside ~10 minutes on a 2-core CPU:
with `--blas auto` (default) the script re-runs itself with a system OpenBLAS
preloaded (LD_PRELOAD; the Linux mlx[cpu] wheel's bundled reference BLAS is
~5x slower), and each batch is split over `--shards 2` processes (data
parallel; gradients summed in a fixed order). `--shards` is part of the recipe,
not a speed knob: changing it changes floating-point rounding.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten
from mlx_lm.models.llama import Model, ModelArgs

from runtime.scheduler.blas import find_openblas

# --------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIALS = [PAD, BOS, EOS, UNK]
CHARS = list("0123456789+= \n")
VOCAB = {t: i for i, t in enumerate(SPECIALS + CHARS)}
PAD_ID, BOS_ID, EOS_ID, UNK_ID = (VOCAB[t] for t in SPECIALS)

MAX_OPERAND_DIGITS = 3
# longest example: "999+999=1998</s>"
MAX_LEN = MAX_OPERAND_DIGITS * 2 + 2 + (MAX_OPERAND_DIGITS + 1) + 1

README_DATE = "2026-11-29"


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab=dict(VOCAB), unk_token=UNK))
    # Every character is its own pre-token.
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    # No post-processor: nothing (no BOS/EOS) is added on encode.
    tok.decoder = decoders.Fuse()  # join characters without spaces
    tok.add_special_tokens(SPECIALS)
    return tok


def save_tokenizer(tok, out: Path):
    tok.save(str(out / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": UNK,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 64,
    }
    with open(out / "tokenizer_config.json", "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    with open(out / "special_tokens_map.json", "w") as f:
        json.dump(
            {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK},
            f,
            indent=2,
        )
        f.write("\n")


def check_tokenizer(out: Path):
    """The saved tokenizer must round-trip through transformers offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(str(out))
    ids = t.encode("12+34=")
    want = [VOCAB[c] for c in "12+34="]
    assert ids == want, (ids, want)
    assert t.decode(t.encode("123")) == "123"
    assert t.decode(t.encode("123") + [EOS_ID], skip_special_tokens=True) == "123"
    assert t.eos_token_id == EOS_ID and t.bos_token_id == BOS_ID
    assert t.pad_token_id == PAD_ID


def encode_text(s: str) -> list[int]:
    return [VOCAB[c] for c in s]


# --------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------


# Probability of 1, 2 and 3 digit operands in *training* batches. Three-digit
# problems (and the carry chains that make the first answer digit hard in
# most-significant-first order) are over-weighted; held-out problems use a
# uniform digit count.
TRAIN_DIGIT_PROBS = (0.2, 0.3, 0.5)


def sample_operands(rng: np.random.Generator, n: int, probs=None) -> np.ndarray:
    """Operands with a random number of digits (1..3; uniform unless `probs`),
    then a uniformly chosen value with exactly that many digits (1-digit
    includes 0)."""
    nd = rng.choice(np.arange(1, MAX_OPERAND_DIGITS + 1), size=n, p=probs)
    lo = np.where(nd == 1, 0, 10 ** (nd - 1))
    hi = 10**nd  # exclusive
    return lo + (rng.random(n) * (hi - lo)).astype(np.int64)


def sample_pairs(rng, n, exclude: np.ndarray | None = None, probs=None):
    a = sample_operands(rng, n, probs)
    b = sample_operands(rng, n, probs)
    if exclude is not None:
        bad = np.isin(a * 1000 + b, exclude)
        while bad.any():
            k = int(bad.sum())
            a[bad] = sample_operands(rng, k, probs)
            b[bad] = sample_operands(rng, k, probs)
            bad = np.isin(a * 1000 + b, exclude)
    return a, b


def make_batch(a: np.ndarray, b: np.ndarray):
    """Right-padded token matrix plus a loss mask that selects the answer
    digits and the final EOS (the prompt "a+b=" is not trained on)."""
    n = len(a)
    toks = np.full((n, MAX_LEN), PAD_ID, dtype=np.int32)
    mask = np.zeros((n, MAX_LEN - 1), dtype=np.float32)
    for i in range(n):
        prompt = f"{a[i]}+{b[i]}="
        ans = str(int(a[i]) + int(b[i]))
        ids = encode_text(prompt + ans) + [EOS_ID]
        toks[i, : len(ids)] = ids
        # target position t predicts toks[t+1]; answer starts at len(prompt)
        mask[i, len(prompt) - 1 : len(ids) - 1] = 1.0
    return toks[:, :-1], toks[:, 1:], mask


# --------------------------------------------------------------------------
# Fast batched greedy evaluation (used for progress lines during training)
# --------------------------------------------------------------------------


def quick_accuracy(model, a: np.ndarray, b: np.ndarray, max_new: int = 6) -> float:
    prompts = [f"{x}+{y}=" for x, y in zip(a, b)]
    answers = [str(int(x) + int(y)) for x, y in zip(a, b)]
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    correct = 0
    for _, idx in sorted(by_len.items()):
        x = mx.array([encode_text(prompts[i]) for i in idx], dtype=mx.int32)
        outs = []
        for _ in range(max_new):
            nxt = mx.argmax(model(x)[:, -1, :], axis=-1).astype(mx.int32)
            outs.append(nxt)
            x = mx.concatenate([x, nxt[:, None]], axis=1)
        gen = np.array(mx.stack(outs, axis=1))
        for row, i in zip(gen, idx):
            s = ""
            for t in row:
                if t == EOS_ID:
                    break
                s += (SPECIALS + CHARS)[t]
            else:
                s = None  # no EOS -> wrong
            correct += s == answers[i]
    return correct / len(prompts)


# --------------------------------------------------------------------------
# Final evaluation through mlx-lm's own loader and generate_step
# --------------------------------------------------------------------------


def mlx_lm_accuracy(folder: Path, a: np.ndarray, b: np.ndarray, show: int = 5):
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = load(str(folder))
    sampler = make_sampler(temp=0.0)  # greedy
    eos = set(tokenizer.eos_token_ids)
    correct, wrong = 0, []
    for x, y in zip(a, b):
        prompt = f"{x}+{y}="
        ids = tokenizer.encode(prompt)
        out = []
        for tok, _ in generate_step(
            mx.array(ids), model, max_tokens=8, sampler=sampler
        ):
            if tok in eos:
                break
            out.append(tok)
        else:
            out.append(None)
        text = tokenizer.decode([t for t in out if t is not None])
        ok = out[-1:] != [None] and text == str(int(x) + int(y))
        correct += ok
        if not ok:
            wrong.append((prompt, text))
    for p, t in wrong[:show]:
        x, y = p[:-1].split("+")
        print(f"  wrong: {p}{t!r} (want {int(x) + int(y)})")
    return correct / len(a), wrong


# --------------------------------------------------------------------------
# Loss / gradients, optionally spread over worker processes
# --------------------------------------------------------------------------


def masked_ce_sum(model, x, y, m):
    logits = model(x).astype(mx.float32)
    ce = nn.losses.cross_entropy(logits, y, reduction="none")
    return (ce * m).sum()


def make_grad_fn(model):
    """(x, y, mask) -> (sum of masked CE, gradients of that sum)."""
    loss_and_grad = nn.value_and_grad(model, masked_ce_sum)

    def fn(x, y, m):
        loss, grads = loss_and_grad(model, x, y, m)
        mx.eval(loss, grads)
        return loss, grads

    return fn


def _worker_main(conn, margs_dict):
    model = Model(ModelArgs(**margs_dict))
    grad_fn = make_grad_fn(model)
    while True:
        msg = conn.recv()
        if msg is None:
            break
        params, x, y, m = msg
        model.update(tree_unflatten([(k, mx.array(v)) for k, v in params.items()]))
        loss, grads = grad_fn(mx.array(x), mx.array(y), mx.array(m))
        conn.send((loss.item(), tree_map(lambda g: np.array(g), grads)))
    conn.close()


class ShardWorker:
    def __init__(self, margs: ModelArgs):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_worker_main, args=(child, dict(vars(margs))), daemon=True
        )
        self.proc.start()
        child.close()

    def submit(self, params, x, y, m):
        self.conn.send((params, x, y, m))

    def result(self):
        return self.conn.recv()

    def close(self):
        try:
            self.conn.send(None)
        except (BrokenPipeError, OSError):
            pass
        self.proc.join(timeout=10)


# --------------------------------------------------------------------------
# BLAS: the Linux mlx[cpu] wheel bundles the reference BLAS (about 6 GFLOP/s
# on one core). A system OpenBLAS preloaded with LD_PRELOAD is ~5x faster;
# the runtime's workers do the same, with the same finder (runtime/scheduler/blas.py).
# --------------------------------------------------------------------------

_REEXEC_FLAG = "TRAIN_ADDER_BLAS"


def maybe_reexec_with_openblas(mode: str) -> str:
    """With --blas auto on Linux, re-run this script with OpenBLAS preloaded
    (one thread per process, so results do not depend on the core count).
    Returns a description of the BLAS in use."""
    if os.environ.get(_REEXEC_FLAG):
        return os.environ[_REEXEC_FLAG]
    lib = find_openblas() if mode == "auto" and sys.platform.startswith("linux") else None
    if lib is None or lib in os.environ.get("LD_PRELOAD", ""):
        desc = f"OpenBLAS {lib} (already preloaded)" if lib else "bundled"
        os.environ[_REEXEC_FLAG] = desc
        return desc
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(x for x in (lib, env.get("LD_PRELOAD", "")) if x)
    env["OPENBLAS_NUM_THREADS"] = "1"
    env[_REEXEC_FLAG] = f"OpenBLAS {lib} (LD_PRELOAD, 1 thread per process)"
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable] + sys.argv, env)


# --------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="models/adder")
    p.add_argument("--steps", type=int, default=3200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--intermediate-size", type=int, default=512)
    p.add_argument(
        "--shards",
        type=int,
        default=2,
        help="data-parallel processes; part of the recipe (changes rounding), "
        "not a speed knob to tune per machine",
    )
    p.add_argument(
        "--blas",
        choices=["auto", "bundled"],
        default="auto",
        help="auto: preload a system OpenBLAS when installed (Linux); "
        "bundled: mlx's own (reference) BLAS",
    )
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--n-heldout", type=int, default=500)
    args = p.parse_args()
    blas = maybe_reexec_with_openblas(args.blas)
    print(f"BLAS: {blas}", flush=True)

    t0 = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    mx.random.seed(args.seed)
    rng = np.random.default_rng(args.seed)
    # Held-out problems come from their own stream and are never trained on.
    ho_rng = np.random.default_rng([args.seed, 1])
    ho_a, ho_b = sample_pairs(ho_rng, args.n_heldout)
    heldout = np.unique(ho_a * 1000 + ho_b)

    tok = build_tokenizer()
    assert tok.get_vocab_size() == len(VOCAB)

    margs = ModelArgs(
        model_type="llama",
        hidden_size=args.hidden_size,
        num_hidden_layers=args.layers,
        intermediate_size=args.intermediate_size,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        rms_norm_eps=1e-5,
        vocab_size=len(VOCAB),
        max_position_embeddings=64,
        rope_theta=10000.0,
        tie_word_embeddings=True,
    )
    model = Model(margs)
    # Smaller embedding init works better for a tied, tiny vocab.
    model.model.embed_tokens.weight = (
        mx.random.normal(model.model.embed_tokens.weight.shape) * 0.02
    )
    mx.eval(model.parameters())
    nparams = sum(v.size for _, v in tree_flatten(model.parameters()))
    print(f"model: {nparams/1e6:.3f}M params, args={margs}", flush=True)

    sched = optim.join_schedules(
        [
            optim.linear_schedule(1e-7, args.lr, args.warmup),
            optim.cosine_decay(args.lr, max(1, args.steps - args.warmup), args.lr * 0.02),
        ],
        [args.warmup],
    )
    opt = optim.AdamW(learning_rate=sched, betas=[0.9, 0.98], weight_decay=args.weight_decay)

    # Data parallel over `--shards` processes (mlx[cpu] matmuls run on one
    # core, so a second process roughly doubles throughput on a 2-core box).
    # Shard 0 runs here, the others in spawned workers; the gradient sum is
    # always taken in shard order, so results do not depend on timing.
    grad_fn = make_grad_fn(model)
    workers = [ShardWorker(margs) for _ in range(args.shards - 1)]
    state = [model.state, opt.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def apply_update(grads, n_tokens):
        grads = tree_map(lambda g: g / n_tokens, grads)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(model, grads)

    print(
        f"training {args.steps} steps, batch {args.batch_size} "
        f"in {args.shards} shard(s)",
        flush=True,
    )
    losses = []
    tt = time.time()
    try:
        for it in range(1, args.steps + 1):
            a, b = sample_pairs(rng, args.batch_size, heldout, TRAIN_DIGIT_PROBS)
            x, y, m = make_batch(a, b)
            parts = np.array_split(np.arange(args.batch_size), args.shards)
            if workers:
                params = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
                for w, idx in zip(workers, parts[1:]):
                    w.submit(params, x[idx], y[idx], m[idx])
            idx = parts[0]
            loss_sum, grads = grad_fn(mx.array(x[idx]), mx.array(y[idx]), mx.array(m[idx]))
            for w in workers:
                l_w, g_w = w.result()
                loss_sum = loss_sum + l_w
                grads = tree_map(lambda g, h: g + mx.array(h), grads, g_w)
            n_tokens = mx.array(float(m.sum()))
            apply_update(grads, n_tokens)
            mx.eval(state)
            losses.append(loss_sum.item() / float(m.sum()))
            if it % args.eval_every == 0 or it == args.steps:
                acc = quick_accuracy(model, ho_a[:200], ho_b[:200])
                print(
                    f"step {it:5d}  loss {np.mean(losses):.4f}  "
                    f"heldout exact-match(200) {acc*100:5.1f}%  "
                    f"lr {sched(mx.array(it)).item():.2e}  {time.time()-tt:6.1f}s",
                    flush=True,
                )
                losses = []
    finally:
        for w in workers:
            w.close()
    train_time = time.time() - tt

    # ---- save in mlx-lm format -------------------------------------------
    weights = dict(tree_flatten(model.parameters()))
    weights = {k: v.astype(mx.float32) for k, v in weights.items()}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": margs.hidden_size,
        "num_hidden_layers": margs.num_hidden_layers,
        "intermediate_size": margs.intermediate_size,
        "num_attention_heads": margs.num_attention_heads,
        "num_key_value_heads": margs.num_key_value_heads,
        "head_dim": margs.hidden_size // margs.num_attention_heads,
        "rms_norm_eps": margs.rms_norm_eps,
        "vocab_size": margs.vocab_size,
        "max_position_embeddings": margs.max_position_embeddings,
        "rope_theta": margs.rope_theta,
        "rope_traditional": margs.rope_traditional,
        "rope_scaling": None,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        "torch_dtype": "float32",
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
    }
    with open(out / "config.json", "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    with open(out / "generation_config.json", "w") as f:
        json.dump(
            {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID},
            f,
            indent=2,
        )
        f.write("\n")
    save_tokenizer(tok, out)
    check_tokenizer(out)

    # ---- final evaluation via mlx_lm.load + generate_step ------------------
    te = time.time()
    acc, wrong = mlx_lm_accuracy(out, ho_a, ho_b)
    eval_time = time.time() - te
    print(
        f"final held-out exact-match (mlx_lm.load + greedy generate_step, "
        f"{len(ho_a)} problems): {acc*100:.1f}%  ({len(wrong)} wrong, eval {eval_time:.1f}s)",
        flush=True,
    )
    total = time.time() - t0
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())

    cmd = f"python scripts/train_adder.py --out {args.out} --steps {args.steps} --seed {args.seed}"
    defaults = {a.dest: a.default for a in p._actions if a.dest not in ("help",)}
    extra = [
        f"--{k.replace('_', '-')} {v}"
        for k, v in vars(args).items()
        if k not in ("out", "steps", "seed") and v != defaults.get(k)
    ]
    if extra:
        cmd += " " + " ".join(extra)
    readme = f"""# adder: the project's embedded default model

A tiny character-level llama ({nparams/1e6:.2f}M parameters, float32) trained
from scratch by this project to add two integers of 1 to 3 digits.

- Prompt format: exactly `"<a>+<b>="`, e.g. `"123+45="` (no BOS, no spaces).
- Output: the decimal sum, most significant digit first, then `</s>`
  (e.g. `"168"` + `</s>`). Greedy decoding.
- Tokenizer: one token per character; vocabulary
  `<pad>`=0, `<s>`=1, `</s>`=2, `<unk>`=3, `0`-`9`=4-13, `+`=14, `=`=15,
  space=16, newline=17. Encoding adds no special tokens. `eos_token_id` = {EOS_ID}.
- Architecture: mlx-lm `llama`, hidden {margs.hidden_size}, {margs.num_hidden_layers} layers,
  {margs.num_attention_heads} heads, intermediate {margs.intermediate_size}, tied embeddings,
  rope_theta {margs.rope_theta:g}.

## How it was made

    {cmd}

(`scripts/train_adder.py`, seed {args.seed}, {args.steps} steps of batch {args.batch_size},
AdamW lr {args.lr:g} with warmup + cosine decay, loss on the answer digits and `</s>` only;
training operands have 1/2/3 digits with probability {"/".join(f"{v:g}" for v in TRAIN_DIGIT_PROBS)};
data parallel over {args.shards} process(es); BLAS: {blas};
training took {train_time/60:.1f} min on a 2-core CPU with mlx {mx.__version__}).
Training is deterministic for a given seed on a given machine and BLAS.

Held-out accuracy: {acc*100:.1f}% exact match on {len(ho_a)} random problems that were
excluded from training (operand digit counts uniform in 1..3), measured after
reloading this folder with `mlx_lm.load` and greedy `mlx_lm.generate.generate_step`.

Date: {README_DATE}.
"""
    with open(out / "README.md", "w") as f:
        f.write(readme)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(
        f"saved {out} ({size/1e6:.2f} MB); train {train_time:.1f}s, total {total:.1f}s",
        flush=True,
    )


if __name__ == "__main__":
    main()

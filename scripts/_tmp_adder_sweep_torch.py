# TEMPORARY (hyper-parameter sweep helper, to be deleted): a torch replica of
# mlx_lm's llama + the adder training loop, to find a config that learns fast.
import argparse, json, math, sys, time
import torch, torch.nn as nn, torch.nn.functional as F

PAD, BOS, EOS = 0, 1, 2
D0, PLUS, EQ = 4, 14, 15
V = 18
T = 13
USE_BOS = False


class RMS(nn.Module):
    def __init__(s, d):
        super().__init__(); s.w = nn.Parameter(torch.ones(d))
    def forward(s, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * s.w


def rope(x, base=10000.0):
    B, H, L, D = x.shape
    half = D // 2
    inv = base ** (-torch.arange(0, half, device=x.device, dtype=torch.float32) * 2 / D)
    ang = torch.arange(L, device=x.device, dtype=torch.float32)[:, None] * inv[None]
    c, s = ang.cos(), ang.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], -1)


class Block(nn.Module):
    def __init__(s, d, h, f):
        super().__init__()
        s.h = h
        s.q, s.k, s.v, s.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        s.g, s.u = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False)
        s.dn = nn.Linear(f, d, bias=False)
        s.n1, s.n2 = RMS(d), RMS(d)
    def forward(s, x):
        B, L, D = x.shape
        y = s.n1(x)
        q, k, v = (t(y).view(B, L, s.h, -1).transpose(1, 2) for t in (s.q, s.k, s.v))
        q, k = rope(q), rope(k)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + s.o(a.transpose(1, 2).reshape(B, L, D))
        y = s.n2(x)
        return x + s.dn(F.silu(s.g(y)) * s.u(y))


class M(nn.Module):
    def __init__(s, d, L, h, f):
        super().__init__()
        s.emb = nn.Parameter(torch.randn(V, d) * 0.02)
        s.blocks = nn.ModuleList(Block(d, h, f) for _ in range(L))
        s.norm = RMS(d)
    def forward(s, x):
        h = s.emb[x]
        for b in s.blocks:
            h = b(h)
        return s.norm(h) @ s.emb.T


def digits_table(n, width, dev):
    nums = torch.arange(n, device=dev)
    lens = torch.where(nums == 0, torch.ones_like(nums), torch.floor(torch.log10(nums.clamp(min=1).float())).long() + 1)
    # fix float issues
    lens = torch.tensor([len(str(i)) for i in range(n)], device=dev)
    tab = torch.full((n, width), PAD, device=dev, dtype=torch.long)
    for i in range(n):
        for j, ch in enumerate(str(i)):
            tab[i, j] = D0 + int(ch)
    return tab, lens


NDP = None
def sample(gen, n, nd_max, dev, train=False):
    if train and NDP is not None:
        nd = torch.multinomial(torch.tensor(NDP, device=dev), n, replacement=True, generator=gen) + 1
    else:
        nd = torch.randint(1, nd_max + 1, (n,), generator=gen, device=dev)
    lo = torch.where(nd == 1, torch.zeros_like(nd), 10 ** (nd - 1))
    hi = 10 ** nd
    return lo + (torch.rand(n, generator=gen, device=dev) * (hi - lo)).long()


def build(a, b, tabs):
    (tA, lA), (tS, lS) = tabs
    s = a + b
    la, lb, ls = lA[a], lA[b], lS[s]
    eq = la + 1 + lb
    st = eq + 1
    eos = st + ls
    j = torch.arange(T, device=a.device)[None]
    tok = torch.full((len(a), T), PAD, device=a.device, dtype=torch.long)
    ga = tA[a].gather(1, j.clamp(max=2).expand(len(a), -1).clamp(max=2))
    idxb = (j - la[:, None] - 1).clamp(0, 2)
    gb = tA[b].gather(1, idxb)
    idxs = (j - st[:, None]).clamp(0, 3)
    gs = tS[s].gather(1, idxs)
    tok = torch.where(j < la[:, None], tA[a].gather(1, j.clamp(max=2).expand(len(a), -1)), tok)
    tok = torch.where(j == la[:, None], torch.full_like(tok, PLUS), tok)
    tok = torch.where((j > la[:, None]) & (j < eq[:, None]), gb, tok)
    tok = torch.where(j == eq[:, None], torch.full_like(tok, EQ), tok)
    tok = torch.where((j >= st[:, None]) & (j < eos[:, None]), gs, tok)
    tok = torch.where(j == eos[:, None], torch.full_like(tok, EOS), tok)
    if USE_BOS:
        tok = torch.cat([torch.full((len(a), 1), BOS, device=a.device, dtype=torch.long), tok], 1)
        eq = eq + 1; eos = eos + 1
    x, y = tok[:, :-1], tok[:, 1:]
    jj = torch.arange(tok.shape[1] - 1, device=a.device)[None]
    m = ((jj >= eq[:, None]) & (jj < eos[:, None])).float()
    return x, y, m, eq + 1  # prompt length


@torch.no_grad()
def accuracy(model, a, b, tabs):
    x, y, m, plen = build(a, b, tabs)
    full = torch.cat([x, y[:, -1:]], 1)
    correct = 0
    okall = torch.zeros(len(a), dtype=torch.bool, device=a.device)
    for L in plen.unique().tolist():
        sel = plen == L
        seq = full[sel][:, :L]
        tgt = full[sel]
        for _ in range(6):
            nxt = model(seq)[:, -1].argmax(-1)
            seq = torch.cat([seq, nxt[:, None]], 1)
        gen = seq[:, L:]
        want = torch.cat([tgt[:, L:], torch.full((len(tgt), 6), PAD, device=a.device)], 1)[:, :6]
        # compare up to and including EOS
        eos_pos = (want == EOS).float().argmax(1)
        ok = torch.ones(len(gen), dtype=torch.bool, device=a.device)
        for r in range(6):
            ok &= torch.where(r <= eos_pos, gen[:, r] == want[:, r], torch.ones_like(ok))
        correct += ok.sum().item()
        okall[sel] = ok
    accuracy.last = okall
    return correct / len(a)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--d", type=int); p.add_argument("--L", type=int); p.add_argument("--h", type=int, default=4)
    p.add_argument("--f", type=int); p.add_argument("--bs", type=int); p.add_argument("--lr", type=float)
    p.add_argument("--examples", type=int); p.add_argument("--seed", type=int, default=0)
    p.add_argument("--wd", type=float, default=0.01); p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--nd", type=int, default=3); p.add_argument("--tag", default="")
    p.add_argument("--eval_every", type=int, default=10000)
    p.add_argument("--bos", action="store_true")
    p.add_argument("--ndp", default="")
    a = p.parse_args()
    global USE_BOS, NDP
    USE_BOS = a.bos
    NDP = [float(v) for v in a.ndp.split(",")] if a.ndp else None
    dev = "cuda"
    torch.manual_seed(a.seed)
    gen = torch.Generator(device=dev); gen.manual_seed(a.seed)
    tabs = (digits_table(1000, 3, dev), digits_table(2000, 4, dev))
    model = M(a.d, a.L, a.h, a.f).to(dev)
    P = sum(t.numel() for t in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.98), weight_decay=a.wd)
    steps = a.examples // a.bs
    def lr_at(i):
        if i < a.warmup:
            return a.lr * i / a.warmup
        t = (i - a.warmup) / max(1, steps - a.warmup)
        lo = a.lr * 0.02
        return lo + (a.lr - lo) * 0.5 * (1 + math.cos(math.pi * t))
    g2 = torch.Generator(device=dev); g2.manual_seed(12345)
    ha, hb = sample(g2, 1000, a.nd, dev), sample(g2, 1000, a.nd, dev)
    t0 = time.time()
    seen = 0; nxt_eval = a.eval_every; hist = []
    for i in range(1, steps + 1):
        for gp in opt.param_groups: gp["lr"] = lr_at(i)
        xa, xb = sample(gen, a.bs, a.nd, dev, True), sample(gen, a.bs, a.nd, dev, True)
        x, y, m, _ = build(xa, xb, tabs)
        logits = model(x)
        ce = F.cross_entropy(logits.reshape(-1, V), y.reshape(-1), reduction="none").view_as(m)
        loss = (ce * m).sum() / m.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        seen += a.bs
        if seen >= nxt_eval or i == steps:
            nxt_eval += a.eval_every
            acc = accuracy(model, ha, hb, tabs)
            hist.append((seen, round(loss.item(), 4), acc))
            print(json.dumps(dict(cfg=f"d{a.d} L{a.L} f{a.f} bs{a.bs} lr{a.lr} bos{int(a.bos)} ndp{a.ndp} s{a.seed}", seen=seen, loss=hist[-1][1], acc=acc, t=round(time.time()-t0,1))), flush=True)
    ha, hb = sample(g2, 4000, a.nd, dev), sample(g2, 4000, a.nd, dev)
    acc = accuracy(model, ha, hb, tabs); ok = accuracy.last
    la = torch.tensor([len(str(v)) for v in ha.tolist()], device=dev); lb = torch.tensor([len(str(v)) for v in hb.tolist()], device=dev)
    combo = {f"{i}+{j}": round(ok[(la == i) & (lb == j)].float().mean().item(), 3) for i in range(1, 4) for j in range(1, 4)}
    carry = (ha + hb) >= 10 ** torch.maximum(la, lb)
    combo["newdigit"] = round(ok[carry].float().mean().item(), 3); combo["nonew"] = round(ok[~carry].float().mean().item(), 3)
    print(json.dumps(dict(combo=combo, acc4000=acc, cfg=f"d{a.d} L{a.L} f{a.f} bs{a.bs} lr{a.lr} bos{int(a.bos)} ndp{a.ndp} s{a.seed}")), flush=True)
    print(json.dumps(dict(final=True, **vars(a), P=P, hist=hist, secs=round(time.time() - t0, 1))), flush=True)


if __name__ == "__main__":
    main()

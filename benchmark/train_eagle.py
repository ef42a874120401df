"""Train an EAGLE head for a Llama-family model on the CPU, from the model's own answers.

    python benchmark/train_eagle.py                          # the default model, ~30 minutes on 2 cores
    python benchmark/train_eagle.py --out HEAD --minutes 10  # a shorter run
    python -m srt.launch_server --speculative-algorithm EAGLE --speculative-draft-model-path HEAD
    python benchmark/bench_speculative.py --algorithm EAGLE --draft-model HEAD

Self-distillation, in four stages (each with a progress bar):
1. **Answers.** The bundled prompts (topics x instructions, chat-formatted with the model's template;
   none of benchmark/bench_speculative.py's questions or topics) are answered greedily by the model
   itself through `Engine`, so the head learns what the server will say.
2. **Features.** HF transformers (float32) runs the model over every prompt + answer: each position's
   last hidden state after the final norm (what the server hands an EAGLE head) and its top-1 token.
3. **Training.** The head is SGLang's EAGLE layout: `fc` (2H -> H, bias) over [embedding of token t+1,
   feature of position t], then one Llama decoder layer without an input norm (random init, or
   `--init-layer N`), whose output predicts the feature at t+1; logits through the model's own LM
   head. Loss: smooth L1 on the feature + 0.1 x cross-entropy on the model's top-1 token (EAGLE's
   recipe, with its uniform noise on input features). With `--ttt K` (default 2) the head is also
   trained on its own output, as EAGLE-3's training-time test: pass k's row t reads pass k-1's
   output at t-1 and attends to the true features up to t-k+1 and its own chain after, exactly the
   KV a k-th draft level sees in the server. Training stops at the time budget (cosine schedule).
4. **Held-out acceptance.** On prompts held out from training: the top-1 accuracy of each draft level
   given the levels before were right (a_1, a_2, ...), and what a chain of depth D then accepts per
   step, sum_d prod_{k<=d} a_k (what `spec_accept_length` - 1 would be for a chain), before and
   after training.

The head is written as `config.json` + `model.safetensors` (+ `training.json`: figures, CPU, command;
`token_map.pt`: the `--token-map-size` tokens the model says most, for `--speculative-token-map`:
the head is trained and measured drafting only those, which also makes training steps cheaper);
the tokenizer files are copied so the folder loads on its own. `--answers FILE` keeps stage 1's
answers for another run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from tqdm import tqdm  # noqa: E402

TOPICS = [
    "the water cycle",
    "black holes",
    "photosynthesis",
    "the Roman Empire",
    "volcanoes",
    "honey bees",
    "the stock market",
    "machine learning",
    "the human heart",
    "coffee",
    "chess",
    "the moon landing",
    "electric cars",
    "rainforests",
    "the printing press",
    "jazz music",
    "sleep",
    "recycling",
    "the Great Wall of China",
    "earthquakes",
    "penguins",
    "the internet",
    "vaccines",
    "solar panels",
    "the Olympic Games",
    "ancient Egypt",
    "climate change",
    "friendship",
    "learning a new language",
    "public speaking",
    "time management",
    "saving money",
    "gardening",
    "the ocean tides",
    "dinosaurs",
    "the piano",
    "mountain climbing",
    "a rainy day",
    "a lighthouse keeper",
    "a lost cat",
    "a robot chef",
    "a city at night",
    "the first day of school",
    "a trip to the desert",
    "an old library",
    "snowflakes",
    "the speed of light",
    "gravity",
    "the French Revolution",
    "the immune system",
    "DNA",
    "sorting algorithms",
    "databases",
    "the Python language",
    "unit testing",
    "version control",
    "a job interview",
    "moving to a new city",
    "teamwork",
    "the scientific method",
    "bridges",
    "the camera",
    "tea ceremonies",
    "the periodic table",
]
INSTRUCTIONS = [
    "Explain {t} to a beginner.",
    "Write a short poem about {t}.",
    "What are three interesting facts about {t}?",
    "Tell me a short story involving {t}.",
    "What are the pros and cons of {t}?",
    "Summarize what people should know about {t}.",
    "Write a friendly email to a colleague about {t}.",
    "Give me some practical tips related to {t}.",
]
HELD_OUT_EVERY = 16  # every 16th prompt is held out from training


def prompts() -> tuple[list[str], list[str]]:
    all_ = [i.format(t=t) for t in TOPICS for i in INSTRUCTIONS]
    train = [p for k, p in enumerate(all_) if k % HELD_OUT_EVERY != HELD_OUT_EVERY - 1]
    held = [p for k, p in enumerate(all_) if k % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
    return train, held


def cpu_has_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


# -- stage 1 and 2: answers and features ------------------------------------------------------------


def answer(model_path: str, questions: list[str], max_new_tokens: int, tok) -> list[tuple[list[int], int]]:
    """Each question chat-formatted, then the model's greedy answer: (prompt + answer token ids,
    the prompt's length)."""
    from srt.entrypoints.engine import Engine

    ids = []
    for q in questions:
        x = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        ids.append(list(x["input_ids"]) if hasattr(x, "keys") else list(x))
    seqs: list[tuple[list[int], int]] = []
    engine = Engine(model_path=model_path, log_level="warning")
    try:
        bar = tqdm(total=len(ids), desc="answers", unit="prompt")
        for k in range(0, len(ids), 64):
            chunk = ids[k : k + 64]
            outs = engine.generate(
                input_ids=chunk, sampling_params={"temperature": 0, "max_new_tokens": max_new_tokens}
            )
            assert isinstance(outs, list)
            seqs += [(p + o["output_ids"], len(p)) for p, o in zip(chunk, outs)]
            bar.update(len(chunk))
        bar.close()
    finally:
        engine.shutdown()
    return seqs


@torch.no_grad()
def features(hf, seqs: list[tuple[list[int], int]], desc: str) -> list[tuple]:
    """Per sequence: token ids, the final-norm hidden states (float32), the model's top-1 tokens and
    the prompt's length."""
    out = []
    lm_head = hf.get_output_embeddings().weight
    for ids, prompt_len in tqdm(seqs, desc=desc, unit="seq"):
        x = torch.tensor([ids])
        h = hf.model(input_ids=x).last_hidden_state[0]
        top1 = torch.cat([(part @ lm_head.T).argmax(-1) for part in h.split(256)])
        out.append((x[0], h.float(), top1, prompt_len))
    return out


# -- the head ---------------------------------------------------------------------------------------


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps).to(x.dtype) * w


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


# checkpoint name -> the Head's attribute
NAMES = {
    "fc.weight": "fc.weight",
    "fc.bias": "fc.bias",
    **{f"layers.0.self_attn.{p}_proj.weight": f"{p}_proj.weight" for p in "qkvo"},
    **{f"layers.0.mlp.{p}_proj.weight": f"{p}_proj.weight" for p in ("gate", "up", "down")},
    "layers.0.post_attention_layernorm.weight": "post_norm",
}


class Head(nn.Module):
    """EAGLE-1: fc over [embedding, feature], one Llama decoder layer without an input norm; the
    parameter names are the checkpoint's (`fc.*`, `layers.0.*`)."""

    def __init__(self, cfg: dict, init: dict[str, torch.Tensor] | None = None):
        super().__init__()
        h, inter = cfg["hidden_size"], cfg["intermediate_size"]
        self.heads, self.kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.head_dim = cfg.get("head_dim") or h // self.heads
        self.eps = cfg["rms_norm_eps"]
        rope = cfg.get("rope_parameters") or {}
        self.theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        self.fc = nn.Linear(2 * h, h, bias=True)
        with torch.no_grad():  # start by passing the feature through
            self.fc.weight.zero_()
            self.fc.weight[:, h:] = torch.eye(h)
            self.fc.bias.zero_()
        d = self.head_dim
        self.q_proj = nn.Linear(h, self.heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, h, bias=False)
        self.gate_proj = nn.Linear(h, inter, bias=False)
        self.up_proj = nn.Linear(h, inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)
        self.post_norm = nn.Parameter(torch.ones(h))
        if init:
            with torch.no_grad():
                for name, t in init.items():
                    self.state_dict_names()[name].copy_(t)

    def state_dict_names(self) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors by name."""
        out = {}
        for name, attr in NAMES.items():
            obj = self
            for part in attr.split("."):
                obj = getattr(obj, part)
            out[name] = obj
        return out

    def rope(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        inv = 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        f = torch.outer(torch.arange(length).float(), inv)
        f = torch.cat([f, f], -1)
        return f.cos(), f.sin()

    def passes(self, emb: torch.Tensor, feat: torch.Tensor, depth: int, noise: float = 0.0) -> list[torch.Tensor]:
        """The head's output rows for draft levels 1..depth (see the module docstring). emb[t] is the
        embedding of token t+1, feat[t] the feature at t; [B, L, H] each."""
        b, length, _ = emb.shape
        cos, sin = self.rope(length)
        d, rep = self.head_dim, self.heads // self.kv_heads
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        outs: list[torch.Tensor] = []
        inp = feat
        if noise:
            inp = inp + (torch.rand_like(inp) - 0.5) * noise
        idx = torch.arange(length)
        for k in range(1, depth + 1):
            if k > 1:  # row t reads the previous level's output at t - 1
                inp = torch.cat([torch.zeros_like(outs[-1][:, :1]), outs[-1][:, :-1]], 1)
            x = self.fc(torch.cat([emb, inp], -1))
            q = rotate(self.q_proj(x).view(b, length, self.heads, d).transpose(1, 2), cos, sin)
            keys.append(rotate(self.k_proj(x).view(b, length, self.kv_heads, d).transpose(1, 2), cos, sin))
            values.append(self.v_proj(x).view(b, length, self.kv_heads, d).transpose(1, 2))
            # level k's row t: level 1's keys up to t - k + 1, then level j's key at t - (k - j)
            allow = [idx[None, :] <= idx[:, None] - (k - 1)]
            allow += [idx[None, :] == idx[:, None] - (k - j) for j in range(2, k + 1)]
            mask = torch.cat(allow, 1)
            mask[:, 0] |= ~mask.any(1)  # a row with nothing to see (t < k - 1) reads key 0; it is not scored
            kk = torch.cat(keys, 2).repeat_interleave(rep, 1)
            vv = torch.cat(values, 2).repeat_interleave(rep, 1)
            att = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)
            x = x + self.o_proj(att.transpose(1, 2).reshape(b, length, -1))
            y = rms(x, self.post_norm, self.eps)
            outs.append(x + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y)))
        return outs


# -- batches, loss, evaluation ----------------------------------------------------------------------


def batches(data, max_tokens: int, generator: torch.Generator | None):
    """Sequences grouped to about max_tokens (padded to the longest), shuffled when a generator is given."""
    order = torch.randperm(len(data), generator=generator).tolist() if generator else list(range(len(data)))
    group: list = []
    for i in order:
        group.append(data[i])
        if sum(len(g[0]) for g in group) >= max_tokens:
            yield pad(group)
            group = []
    if group:
        yield pad(group)


def pad(group):
    """[B, L] token ids of t+1, [B, L, H] features of t, [B, L] targets (token t+2), [B, L, H] features
    of t+1, [B, L] valid; L = longest - 2."""
    length = max(len(g[0]) for g in group) - 2
    hdim = group[0][1].shape[-1]
    b = len(group)
    nxt = torch.zeros(b, length, dtype=torch.long)
    feat = torch.zeros(b, length, hdim)
    target = torch.zeros(b, length, dtype=torch.long)
    feat_next = torch.zeros(b, length, hdim)
    valid = torch.zeros(b, length, dtype=torch.bool)
    for i, (ids, h, top1, prompt_len) in enumerate(group):
        n = len(ids) - 2
        nxt[i, :n] = ids[1 : n + 1]
        feat[i, :n] = h[:n]
        target[i, :n] = top1[1 : n + 1]  # the model's top-1 after token t+1 (its greedy answer)
        feat_next[i, :n] = h[1 : n + 1]
        valid[i, max(prompt_len - 2, 0) : n] = True  # rows predicting an answer token (drafts are for those)
    return nxt, feat, target, feat_next, valid


def loss_of(head, embed, rows, remap, batch, depth, noise, autocast):
    """`rows`: the LM head's rows of the drafted vocabulary; `remap`: a target id's index among them
    (-100 outside it: no cross-entropy there)."""
    nxt, feat, target, feat_next, valid = batch
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        outs = head.passes(F.embedding(nxt, embed), feat, depth, noise)
        total = torch.zeros(())
        for k, out in enumerate(outs, start=1):
            ok = valid.clone()
            ok[:, : k - 1] = False  # level k needs k - 1 earlier rows
            o = out[ok]
            logits = (o @ rows.T).float()
            labels = remap[target[ok]]
            ce = F.cross_entropy(logits, labels) if bool((labels >= 0).any()) else logits.sum() * 0
            reg = F.smooth_l1_loss(o.float(), feat_next[ok])
            total = total + 0.8 ** (k - 1) * (reg + 0.1 * ce)
    return total


@torch.no_grad()
def evaluate(head, embed, rows, remap, data, depth: int, autocast: bool) -> dict:
    """Each level's top-1 accuracy given the levels before were right, level 1's top-4 recall, and a
    chain's expected accepted drafts per step; drafts are of the vocabulary `rows` (see loss_of)."""
    hits = [0] * depth
    seen = [0] * depth
    top4 = 0
    for batch in batches(data, 4096, None):
        nxt, feat, target, _, valid = batch
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            outs = head.passes(F.embedding(nxt, embed), feat, depth)
        for k, out in enumerate(outs, start=1):
            ok = valid.clone()
            ok[:, : k - 1] = False
            logits = out[ok].float() @ rows.T.float()
            labels = remap[target[ok]]
            hits[k - 1] += int((logits.argmax(-1) == labels).sum())
            seen[k - 1] += int(ok.sum())
            if k == 1:
                top4 += int((logits.topk(4, -1).indices == labels[:, None]).any(-1).sum())
    acc = [h / max(s, 1) for h, s in zip(hits, seen)]
    chain, prod = [], 1.0
    for a in acc:
        prod *= a
        chain.append((chain[-1] if chain else 0.0) + prod)
    return {"level_accuracy": acc, "top4_level1": top4 / max(seen[0], 1), "chain_accepted": chain}


def show(name: str, ev: dict) -> str:
    levels = " ".join(f"{a:.3f}" for a in ev["level_accuracy"])
    chain = " ".join(f"{c:.2f}" for c in ev["chain_accepted"])
    return f"{name}: level top-1 accuracy {levels}; level-1 top-4 {ev['top4_level1']:.3f}; chain accepts {chain}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="default: the default model")
    ap.add_argument("--out", default=os.path.expanduser("~/.cache/radixserve/heads/default-eagle"))
    ap.add_argument("--minutes", type=float, default=30.0, help="the whole run's budget; training gets what is left")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--num-prompts", type=int, default=None, help="use only the first N training prompts")
    ap.add_argument("--ttt", type=int, default=2, help="draft levels trained (1 = plain EAGLE)")
    ap.add_argument("--eval-depth", type=int, default=4)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--noise", type=float, default=0.2, help="uniform noise width on input features")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init-layer", type=int, default=None, help="start the decoder layer from this model layer")
    ap.add_argument("--answers", default=None, help="a JSON cache of the answers: read if present, else written")
    ap.add_argument(
        "--token-map-size",
        type=int,
        default=8192,
        help="also write token_map.pt: the N tokens the model says most (for --speculative-token-map; 0: none)",
    )
    args = ap.parse_args()
    started = time.monotonic()
    deadline = started + args.minutes * 60
    torch.manual_seed(args.seed)
    from transformers import AutoModelForCausalLM

    from srt.hf_transformers_utils import get_tokenizer
    from srt.model_loader.default_model import resolve_model_path

    model = resolve_model_path(args.model_path)
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    if cfg.get("architectures", [""])[0] not in ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"):
        sys.exit(f"--model-path {model}: an EAGLE head is trained for a Llama-family model, not {cfg['architectures']}")
    autocast = cpu_has_bf16()
    print(f"model {model}; {torch.get_num_threads()} threads; bf16 autocast {'on' if autocast else 'off'}")
    tok = get_tokenizer(model)
    train_q, held_q = prompts()
    if args.num_prompts:
        train_q = train_q[: args.num_prompts]
    questions = train_q + held_q
    cache = args.answers
    if cache and os.path.exists(cache):
        with open(cache) as f:
            saved = json.load(f)
        if saved["questions"] != questions or saved["max_new_tokens"] != args.max_new_tokens:
            sys.exit(f"--answers {cache}: made for other prompts or --max-new-tokens; remove it to regenerate")
        seqs = [(ids, n) for ids, n in saved["seqs"]]
        print(f"answers: {len(seqs)} from {cache}")
    else:
        seqs = answer(model, questions, args.max_new_tokens, tok)
        if cache:
            with open(cache, "w") as f:
                json.dump({"questions": questions, "max_new_tokens": args.max_new_tokens, "seqs": seqs}, f)
    train_seqs, held_seqs = seqs[: len(train_q)], seqs[len(train_q) :]
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    train = features(hf, train_seqs, "features")
    held = features(hf, held_seqs, "held-out features")
    embed = hf.get_input_embeddings().weight.detach()
    lm_head = hf.get_output_embeddings().weight.detach()
    vocab = cfg["vocab_size"]
    # FR-Spec: the tokens the model says most in its training answers; the head is trained (and its
    # acceptance measured) drafting only those, as the server drafts with --speculative-token-map
    token_map: dict = {}
    if args.token_map_size:
        said = torch.cat([torch.tensor(ids[n:]) for ids, n in train_seqs])
        hot = torch.bincount(said, minlength=vocab).argsort(descending=True)[: args.token_map_size].clone()
        held_said = torch.cat([torch.tensor(ids[n:]) for ids, n in held_seqs])
        covered = torch.isin(held_said, hot).float().mean().item()
        token_map = {"size": args.token_map_size, "held_out_coverage": covered}
        print(f"token map: the {args.token_map_size} most said tokens cover {covered:.1%} of held-out answers")
    else:
        hot = torch.arange(vocab)
    rows = lm_head[hot]
    remap = torch.full((vocab,), -100, dtype=torch.long)
    remap[hot] = torch.arange(len(hot))
    init = None
    if args.init_layer is not None:
        sd = hf.state_dict()
        init = {
            name: sd[f"model.layers.{args.init_layer}.{name.removeprefix('layers.0.')}"].clone()
            for name in NAMES
            if name.startswith("layers.0.")
        }
    del hf
    head = Head(cfg, init)
    before = evaluate(head, embed, rows, remap, held, args.eval_depth, autocast)
    print(show("before training", before))
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.0)
    budget = deadline - time.monotonic() - 60  # a minute for the last evaluation and the save
    if budget <= 0:
        sys.exit(f"--minutes {args.minutes}: nothing left for training after answers and features")
    t0 = time.monotonic()
    g = torch.Generator().manual_seed(args.seed)
    bar = tqdm(total=int(budget), desc="training", unit="s")
    step = epoch = 0
    tokens = 0
    last_loss = float("nan")
    while time.monotonic() - t0 < budget:
        for batch in batches(train, args.batch_tokens, g):
            frac = (time.monotonic() - t0) / budget
            if frac >= 1:
                break
            warm = min(1.0, (step + 1) / 50)
            for group in opt.param_groups:
                group["lr"] = args.lr * warm * 0.5 * (1 + math.cos(math.pi * frac))
            loss = loss_of(head, embed, rows, remap, batch, args.ttt, args.noise, autocast)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
            opt.step()
            step += 1
            tokens += int(batch[4].sum())
            last_loss = 0.9 * last_loss + 0.1 * float(loss) if step > 1 else float(loss)
            bar.n = int(time.monotonic() - t0)
            bar.set_postfix(step=step, epoch=epoch, loss=f"{last_loss:.3f}")
            bar.refresh()
        epoch += 1
    bar.close()
    after = evaluate(head, embed, rows, remap, held, args.eval_depth, autocast)
    print(show("after training", after))
    os.makedirs(args.out, exist_ok=True)
    from safetensors.torch import save_file

    save_file(
        {k: v.detach().to(torch.bfloat16).contiguous() for k, v in head.state_dict_names().items()},
        os.path.join(args.out, "model.safetensors"),
    )
    head_cfg = {
        **cfg,
        "architectures": ["LlamaForCausalLMEagle"],
        "num_hidden_layers": 1,
        "dtype": "bfloat16",
        "torch_dtype": "bfloat16",
    }
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(head_cfg, f, indent=2)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if os.path.exists(os.path.join(model, name)):
            shutil.copy(os.path.join(model, name), args.out)
    from bench_quant import cpu_summary

    info = {
        "command": " ".join(sys.argv),
        "target": model,
        "cpu": cpu_summary(),
        "train_prompts": len(train_q),
        "held_out_prompts": len(held_q),
        "train_tokens": sum(len(s) for s, _ in train_seqs),
        "train_answer_tokens": sum(len(s) - n for s, n in train_seqs),
        "steps": step,
        "epochs": epoch,
        "tokens_seen": tokens,
        "ttt": args.ttt,
        "minutes": (time.monotonic() - started) / 60,
        "before": before,
        "after": after,
        "token_map": token_map or None,
    }
    with open(os.path.join(args.out, "training.json"), "w") as f:
        json.dump(info, f, indent=2)
    if args.token_map_size:
        torch.save(hot, os.path.join(args.out, "token_map.pt"))
    size = os.path.getsize(os.path.join(args.out, "model.safetensors"))
    print(f"head: {args.out} ({size / 1e6:.1f} MB, bf16); {step} steps, {epoch} epochs, {info['minutes']:.1f} min")


if __name__ == "__main__":
    main()

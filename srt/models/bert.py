"""BERT encoders (HF `BertModel`, `BertForSequenceClassification`) over a packed batch: the T rows of
`input_ids` are the batch's sequences one after another, `seq_lens` says where each ends, and every
token attends to every token of its own sequence (bidirectional, no KV cache: an encoder runs each
input once).

- **Embeddings.** Word + token type (0 when not given) + absolute position embeddings, then
  LayerNorm. `positions` restart at 0 in each sequence, as HF's default `position_ids`.
- **Layers.** Post-norm: LayerNorm(x + attention(x)), then LayerNorm(x + dense(act(dense(x)))).
  Query, key and value are one fused projection (one GEMM instead of three); the checkpoint's
  `attention.self.{query,key,value}` fill its thirds.
- **Attention.** The packed rows are gathered once per layer into a padded [B, heads, max_len, d]
  view and attended with one `scaled_dot_product_attention` call under an additive key mask (built
  once per forward); the outputs are gathered back to the packed rows. On CPU one call for the batch
  beats a call per sequence by far for many short inputs (MiniLM's 12 heads of 32, 64 sequences of
  8-128 tokens, 2 cores: about 80 ms against 650 ms for one layer's attention, the per-call overhead
  dominating), and the padding it wastes is in attention only, never in the projections and the
  MLP, which run on the T packed rows.
  A batch of equal lengths needs neither the gather nor the mask.
- **Heads.** `BertForSequenceClassification` (cross-encoders such as bge-reranker): the pooler
  (dense + tanh on each sequence's first, [CLS], row), then `classifier` to `num_labels` logits.

Checkpoints use HF's names: the classification model's under `bert.` (and `classifier.*`), a
`BertModel`'s with or without `bert.` (sentence-transformers' checkpoints have none). The
`embeddings.position_ids` / `token_type_ids` buffers some checkpoints carry are skipped, and so is
`pooler.*` where the model does not use it (an embedding model pools as its pooling config says).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}

# checkpoint tensors that are buffers, not weights
SKIPPED_BUFFERS = ("embeddings.position_ids", "embeddings.token_type_ids")


def check_config(config) -> None:
    """Refuse what this encoder does not implement, naming the config field."""
    if (kind := getattr(config, "position_embedding_type", "absolute")) != "absolute":
        raise ValueError(f"position_embedding_type={kind!r} is not supported; only 'absolute' is")
    if getattr(config, "is_decoder", False):
        raise ValueError("is_decoder=True (a causal BERT) is not supported; only the bidirectional encoder is")
    if config.hidden_act not in ACTIVATIONS:
        raise ValueError(f"hidden_act={config.hidden_act!r} is not supported; expected one of {sorted(ACTIVATIONS)}")
    if config.hidden_size % config.num_attention_heads:
        raise ValueError(
            f"hidden_size={config.hidden_size} is not a multiple of num_attention_heads={config.num_attention_heads}"
        )


# a group's longest sequence may be up to this much longer than its shortest (padding is attended)
GROUP_SLACK = 1.25
GROUP_SLACK_TOKENS = 8


@dataclass
class SeqGroup:
    """Sequences of similar lengths, attended together as one padded [count, heads, max_len, d] call."""

    count: int
    max_len: int
    key_mask: torch.Tensor | None  # [count, 1, 1, max_len] 0 on a sequence's keys, -inf past its end


@dataclass
class PackedSeqs:
    """Where each sequence's rows lie in a packed [T, ...] batch, and padded views of it by group.

    Sequences are grouped by length (sorted; a group's longest at most GROUP_SLACK times plus
    GROUP_SLACK_TOKENS its shortest), so attention pads each sequence only to its group's longest
    rather than the batch's: with the 8-128 token inputs of an embedding workload that is most of
    the attention's work."""

    seq_lens: list[int]
    groups: list[SeqGroup]
    # [sum count * max_len] the packed row of each padded slot; None: one group of equal lengths
    pad_index: torch.Tensor | None
    unpad_index: torch.Tensor | None  # [T] each packed row's slot in the padded views, in order

    @property
    def max_len(self) -> int:
        return max(self.seq_lens)

    @classmethod
    def from_seq_lens(cls, seq_lens: list[int], device: torch.device, dtype: torch.dtype) -> PackedSeqs:
        assert seq_lens and min(seq_lens) > 0, f"every sequence needs a token: seq_lens={seq_lens}"
        if min(seq_lens) == max(seq_lens):
            return cls(seq_lens, [SeqGroup(len(seq_lens), seq_lens[0], None)], None, None)
        starts = [0]
        for n in seq_lens[:-1]:
            starts.append(starts[-1] + n)
        order = sorted(range(len(seq_lens)), key=seq_lens.__getitem__)
        members: list[list[int]] = []
        for i in order:
            if members and seq_lens[i] <= seq_lens[members[-1][0]] * GROUP_SLACK + GROUP_SLACK_TOKENS:
                members[-1].append(i)
            else:
                members.append([i])
        groups, pad_rows, slot_of_row = [], [], [0] * sum(seq_lens)
        for idx in members:
            lens = [seq_lens[i] for i in idx]
            width = max(lens)
            mask = None
            if min(lens) != width:
                valid = torch.arange(width)[None] < torch.tensor(lens)[:, None]
                mask = torch.zeros(valid.shape, dtype=dtype).masked_fill_(~valid, float("-inf"))[:, None, None]
                mask = mask.to(device)
            groups.append(SeqGroup(len(idx), width, mask))
            for i, n in zip(idx, lens):
                base = len(pad_rows)
                pad_rows.extend(range(starts[i], starts[i] + n))
                pad_rows.extend([starts[i]] * (width - n))  # padding reads some row of its own sequence
                for j in range(n):
                    slot_of_row[starts[i] + j] = base + j
        return cls(
            seq_lens,
            groups,
            torch.tensor(pad_rows, dtype=torch.int64, device=device),
            torch.tensor(slot_of_row, dtype=torch.int64, device=device),
        )


class BertEmbeddings(nn.Module):
    def __init__(self, config, position_offset: int = 0):
        super().__init__()
        self.position_offset = position_offset  # RoBERTa: positions start after the padding index
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor | None
    ) -> torch.Tensor:
        if self.position_offset:
            positions = positions + self.position_offset
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        if token_type_ids is None:
            x = x + self.token_type_embeddings.weight[0]
        else:
            x = x + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(x)


class DenseAddNorm(nn.Module):
    """LayerNorm(dense(x) + residual): BERT's `attention.output` and `output`."""

    def __init__(self, in_features: int, hidden_size: int, eps: float):
        super().__init__()
        self.dense = nn.Linear(in_features, hidden_size)
        self.LayerNorm = nn.LayerNorm(hidden_size, eps=eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.output = DenseAddNorm(config.hidden_size, config.hidden_size, config.layer_norm_eps)

    def forward(self, x: torch.Tensor, seqs: PackedSeqs) -> torch.Tensor:
        qkv = self.qkv(x)
        padded = qkv if seqs.pad_index is None else qkv.index_select(0, seqs.pad_index)
        outs, row = [], 0
        for g in seqs.groups:
            part = padded[row : row + g.count * g.max_len].view(g.count, g.max_len, 3, self.heads, self.head_dim)
            row += g.count * g.max_len
            q, k, v = part.permute(2, 0, 3, 1, 4)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=g.key_mask)
            outs.append(out.transpose(1, 2).reshape(g.count * g.max_len, self.hidden_size))
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        if seqs.unpad_index is not None:
            out = out.index_select(0, seqs.unpad_index)
        return self.output(out, x)


class BertIntermediate(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = DenseAddNorm(config.intermediate_size, config.hidden_size, config.layer_norm_eps)

    def forward(self, x: torch.Tensor, seqs: PackedSeqs) -> torch.Tensor:
        x = self.attention(x, seqs)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))


class BertPooler(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, cls_rows: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(cls_rows))


class BertModel(nn.Module):
    """The encoder's last hidden states, one row per packed token (pooled outside, as configured)."""

    is_encoder = True  # no KV cache, no decoding: srt/pooling runs it
    pooling_kind = "embed"

    def __init__(self, config, quant_config=None, add_pooling_layer: bool = False):
        super().__init__()
        if quant_config is not None:
            raise ValueError(f"{type(self).__name__} runs unquantized; got quantization {quant_config.get_name()!r}")
        check_config(config)
        self.config = config
        self.embeddings = BertEmbeddings(config, self.position_offset(config))
        self.encoder = BertEncoder(config)
        self.pooler = BertPooler(config) if add_pooling_layer else None

    checkpoint_prefix = "bert."

    @staticmethod
    def position_offset(config) -> int:
        return 0

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        seq_lens: list[int],
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions (and token_type_ids) [T] -> hidden states [T, hidden_size]."""
        assert sum(seq_lens) == input_ids.shape[0], f"seq_lens sum to {sum(seq_lens)}, not {input_ids.shape[0]} rows"
        x = self.embeddings(input_ids, positions, token_type_ids)
        seqs = PackedSeqs.from_seq_lens(seq_lens, x.device, x.dtype)
        for layer in self.encoder.layer:
            x = layer(x, seqs)
        return x

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF's tensor names, with or without the `bert.` (RoBERTa: `roberta.`) prefix."""

        def ours(name: str) -> str | None:
            name = name.removeprefix(self.checkpoint_prefix)
            if name in SKIPPED_BUFFERS or (self.pooler is None and name.startswith("pooler.")):
                return None
            return name

        load_hf_weights(self, weights, ours)


class SequenceClassifier(nn.Module):
    """A cross-encoder: one row of `num_labels` logits per sequence (a relevance score when 1), from
    a head over each sequence's first row ([CLS] / <s>)."""

    is_encoder = True
    pooling_kind = "classify"

    def encode(self, input_ids, positions, seq_lens, token_type_ids) -> torch.Tensor:
        raise NotImplementedError

    def head(self, first_rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        seq_lens: list[int],
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions (and token_type_ids) [T] -> logits [B, num_labels]."""
        hidden = self.encode(input_ids, positions, seq_lens, token_type_ids)
        starts = torch.cumsum(torch.tensor([0, *seq_lens[:-1]], device=hidden.device), 0)
        return self.head(hidden[starts])


class BertForSequenceClassification(SequenceClassifier):
    """BERT's: the pooler (dense + tanh), then `classifier`."""

    def __init__(self, config, quant_config=None):
        super().__init__()
        self.config = config
        self.num_labels = config.num_labels
        self.bert = BertModel(config, quant_config=quant_config, add_pooling_layer=True)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    def encode(self, input_ids, positions, seq_lens, token_type_ids) -> torch.Tensor:
        return self.bert(input_ids, positions, seq_lens, token_type_ids)

    def head(self, first_rows: torch.Tensor) -> torch.Tensor:
        assert self.bert.pooler is not None
        return self.classifier(self.bert.pooler(first_rows))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF's tensor names: `bert.*` and `classifier.*`."""
        load_hf_weights(self, weights, lambda name: None if name.removeprefix("bert.") in SKIPPED_BUFFERS else name)


def checkpoint_targets(model: nn.Module) -> dict[str, tuple[torch.Tensor, slice]]:
    """Each HF tensor name the model takes -> (our parameter, the rows it fills): the fused
    `attention.qkv` takes `attention.self.{query,key,value}` as its thirds."""
    targets = {}
    for name, param in model.named_parameters():
        head, sep, kind = name.rpartition(".attention.qkv.")
        if not sep:
            targets[name] = (param, slice(None))
            continue
        third = param.shape[0] // 3
        for i, part in enumerate(("query", "key", "value")):
            targets[f"{head}.attention.self.{part}.{kind}"] = (param, slice(i * third, (i + 1) * third))
    return targets


def load_hf_weights(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], rename: Callable[[str], str | None]
) -> None:
    """Checkpoint tensors into `model`; `rename` maps a checkpoint name to the model's HF name, or to
    None for a tensor to skip. An unknown tensor, a wrong shape or a parameter left unfilled raises
    KeyError (the loader's "weights do not match")."""
    targets = checkpoint_targets(model)
    loaded = set()
    for name, tensor in weights:
        if (target := rename(name)) is None:
            continue
        if target not in targets:
            raise KeyError(f"checkpoint tensor {name!r} has no parameter in {type(model).__name__}")
        param, rows = targets[target]
        dest = param.data[rows]
        if dest.shape != tensor.shape:
            raise KeyError(f"checkpoint tensor {name!r} is {tuple(tensor.shape)}; {target} takes {tuple(dest.shape)}")
        dest.copy_(tensor)
        loaded.add(target)
    if missing := sorted(set(targets) - loaded):
        raise KeyError(f"checkpoint has no tensors for {missing[:6]}")


class RobertaModel(BertModel):
    """RoBERTa / XLM-RoBERTa (bge-m3, multilingual-e5): BERT's encoder with positions counted from
    `pad_token_id + 1` and checkpoint names under `roberta.`."""

    checkpoint_prefix = "roberta."

    @staticmethod
    def position_offset(config) -> int:
        return int(config.pad_token_id) + 1


class XLMRobertaModel(RobertaModel):
    pass


class RobertaClassificationHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.out_proj = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, first_rows: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(first_rows)))


class RobertaForSequenceClassification(SequenceClassifier):
    """A RoBERTa / XLM-R cross-encoder (bge-reranker-v2-m3): dense + tanh + projection on each
    sequence's first (<s>) row, no pooler."""

    def __init__(self, config, quant_config=None):
        super().__init__()
        self.config = config
        self.num_labels = config.num_labels
        self.roberta = RobertaModel(config, quant_config=quant_config)
        self.classifier = RobertaClassificationHead(config)

    def encode(self, input_ids, positions, seq_lens, token_type_ids) -> torch.Tensor:
        return self.roberta(input_ids, positions, seq_lens, token_type_ids)

    def head(self, first_rows: torch.Tensor) -> torch.Tensor:
        return self.classifier(first_rows)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF's tensor names: `roberta.*` (no pooler) and `classifier.{dense,out_proj}.*`."""

        def ours(name: str) -> str | None:
            inner = name.removeprefix("roberta.")
            return None if inner in SKIPPED_BUFFERS or inner.startswith("pooler.") else name

        load_hf_weights(self, weights, ours)


class XLMRobertaForSequenceClassification(RobertaForSequenceClassification):
    pass


EntryClass = [
    BertModel,
    BertForSequenceClassification,
    RobertaModel,
    XLMRobertaModel,
    RobertaForSequenceClassification,
    XLMRobertaForSequenceClassification,
]

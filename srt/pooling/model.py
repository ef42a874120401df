"""What a pooling server serves, read from the model folder: the scheduler pools with it, the
tokenizer side checks inputs and shapes answers with it."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from srt.configs.model_config import ModelLoadError
from srt.models.pooling import PoolingConfig, PoolingMode, load_pooling_config
from srt.models.registry import get_model_class


@dataclass(frozen=True)
class PoolingModel:
    kind: str  # "embed": pooled hidden states; "classify": a classification head's logits
    encoder: bool  # bidirectional, no KV cache (BERT); else a decoder pooled at its last token
    pooling: PoolingConfig | None  # "embed" only
    dims: int  # embedding width, or the number of labels
    max_input_len: int  # tokens one input may have
    labels: tuple[str, ...] = ()  # "classify": each logit's label (config id2label)
    # Matryoshka widths the checkpoint names (config `matryoshka_dimensions`); None: any width up to dims
    matryoshka_dims: tuple[int, ...] | None = None
    segment_ids: bool = False  # the encoder embeds token types (BERT's segments A and B of a pair)

    @classmethod
    def read(cls, model_path: str, hf_config, architecture: str, max_input_len: int) -> PoolingModel:
        """`max_input_len`: the server's limit for a prompt (a decoder's context and KV pool); an
        encoder's own is its position table, or sentence-transformers' `max_seq_length` when smaller."""
        model_cls = get_model_class(architecture)
        encoder = bool(getattr(model_cls, "is_encoder", False))
        kind = getattr(model_cls, "pooling_kind", "embed")
        segment_ids = encoder and int(getattr(hf_config, "type_vocab_size", 1)) > 1
        if encoder:
            # RoBERTa's positions start after its padding index
            position_offset = getattr(model_cls, "position_offset", None)
            offset = int(position_offset(hf_config)) if position_offset is not None else 0
            max_input_len = min(max_input_len, int(hf_config.max_position_embeddings) - offset)
            st_config = os.path.join(model_path, "sentence_bert_config.json")
            if os.path.exists(st_config):
                with open(st_config) as f:
                    max_input_len = min(max_input_len, int(json.load(f).get("max_seq_length") or max_input_len))
        if kind == "classify":
            num_labels = int(hf_config.num_labels)
            id2label = getattr(hf_config, "id2label", None) or {}
            labels = tuple(str(id2label.get(i, id2label.get(str(i), f"LABEL_{i}"))) for i in range(num_labels))
            return cls(kind, encoder, None, num_labels, max_input_len, labels, segment_ids=segment_ids)
        try:
            pooling = load_pooling_config(model_path, causal=not encoder)
        except ValueError as e:
            raise ModelLoadError(str(e)) from e
        if not encoder and pooling.modes != (PoolingMode.LAST_TOKEN,):
            modes = [m.value for m in pooling.modes]
            raise ModelLoadError(
                f"{model_path}: pooling modes {modes} need every row's hidden state; a decoder ({architecture}) "
                "is pooled at its last token here (Qwen3-Embedding's pooling)"
            )
        text = hf_config.get_text_config()
        matryoshka = getattr(hf_config, "matryoshka_dimensions", None)
        return cls(
            kind,
            encoder,
            pooling,
            pooling.output_dim(text.hidden_size),
            max_input_len,
            matryoshka_dims=tuple(int(d) for d in matryoshka) if matryoshka else None,
            segment_ids=segment_ids,
        )

"""Pooling: embeddings, reranking scores and classifier logits served through the scheduler.

- `model`: what a pooling server serves (`PoolingModel`: embedding or classifier, width, input limit,
  the sentence-transformers pooling), read from the model folder by both sides.
- `component`: the scheduler side. An encoder (BERT) runs its own prefill-only packed batches; a
  decoder's pooling requests run as ordinary prefills through the radix cache (shared prefixes are
  reused) and leave after it with their last hidden state, alternating with the decode steps of
  generating requests so neither starves.
- `inputs`: the request side (inputs, cross-encoder pairs, truncation, and the answers' shapes).
"""

"""Images in prompts: reading and decoding them (media), each vision-language architecture's
processor and the prompt expansion with image-keyed pad values (processors). The model side (the
encoders, the embedding merge and the encoder cache) lives in srt/models."""

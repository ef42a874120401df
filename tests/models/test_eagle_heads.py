"""EAGLE draft heads and the target's hidden-state capture, in process (no server): the target's
captured states against HF transformers, SGLang's EAGLE and EAGLE-3 checkpoint layouts, and the
errors for a head that does not fit its target."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import write_eagle_head
from transformers import AutoModelForCausalLM

from srt.configs.model_config import ModelConfig
from srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

PROMPT = [3, 17, 42, 99, 7, 250, 11, 64, 5, 300, 12]


def extend(runner, ids: list[int], **extra):
    """One prefill of `ids` on `runner` (a fresh request row; its KV stays allocated)."""
    row = runner.req_to_token_pool.alloc(1)[0]
    loc = runner.token_to_kv_pool_allocator.alloc(len(ids))
    runner.req_to_token_pool.write(row, 0, loc)
    fb = ForwardBatch.build(ForwardMode.EXTEND, ids, [row], [len(ids)], [0], loc, runner.device, **extra)
    with torch.inference_mode():
        return runner.forward(fb)


def test_target_captures_its_hidden_states_as_hf_computes_them(tiny_model_factory, runner_factory):
    path = tiny_model_factory("LlamaForCausalLM", num_hidden_layers=4)
    runner = runner_factory(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT]), output_hidden_states=True).hidden_states
    plain = extend(runner, PROMPT)
    assert plain.hidden_states is None  # nothing captured unless asked
    out = extend(runner, PROMPT, capture_hidden=True)
    torch.testing.assert_close(out.hidden_states, ref[-1][0], atol=1e-4, rtol=1e-4)  # the final norm's output
    # EAGLE-3: the residual stream entering layers 1, 2 and 3, side by side
    runner.model.model.aux_layers = (1, 3, 2)
    out = extend(runner, PROMPT, capture_hidden=True)
    want = torch.cat([ref[1][0], ref[3][0], ref[2][0]], dim=-1)
    torch.testing.assert_close(out.hidden_states, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.next_token_logits[0], hf(torch.tensor([PROMPT])).logits[0, -1], atol=1e-4, rtol=1e-4)


def head_runner(path: str, architecture: str, target_model):
    """A model runner (KV pool, attention backend) for the head, sharing the target's embedding."""
    from srt.model_executor.model_runner import ModelRunner
    from srt.server_args import ServerArgs

    args = ServerArgs(model_path=path, dtype="float32", max_total_tokens=256, max_running_requests=4)
    config = ModelConfig.from_path(path)
    config.architecture = architecture
    runner = ModelRunner(config, args)
    runner.model.attach_target(target_model.model.embed_tokens, target_model.lm_head)
    return runner


def test_eagle_head_loads_sglang_layout_and_computes_its_formula(tiny_model_factory, runner_factory, tmp_path):
    target_path = tiny_model_factory("LlamaForCausalLM", num_hidden_layers=4)
    target = runner_factory(target_path).model
    path = write_eagle_head(str(tmp_path / "eagle"), target_path, "eagle")
    runner = head_runner(path, "LlamaForCausalLMEagle", target)
    from safetensors.torch import load_file

    w = load_file(os.path.join(path, "model.safetensors"))
    # a one-token row through the formula by hand: fc([embed, hidden]), attention over itself (its
    # value, o_proj), the post-attention norm and MLP on the residual stream, no final norm
    tok, hidden = 17, torch.randn(1, 64)
    emb = target.model.embed_tokens.weight[tok : tok + 1]
    x = torch.cat([emb, hidden], -1) @ w["fc.weight"].T + w["fc.bias"]
    v = x @ w["layers.0.self_attn.v_proj.weight"].T  # a single key: attention returns its value
    v = v.view(1, 2, 16).repeat_interleave(2, dim=1).reshape(1, 64)  # 4 query heads over 2 KV heads
    x = x + v @ w["layers.0.self_attn.o_proj.weight"].T
    n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    gate, up = n @ w["layers.0.mlp.gate_proj.weight"].T, n @ w["layers.0.mlp.up_proj.weight"].T
    want = x + (torch.nn.functional.silu(gate) * up) @ w["layers.0.mlp.down_proj.weight"].T
    out = extend(runner, [tok], spec_hidden=hidden)
    torch.testing.assert_close(out.hidden_states, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.next_token_logits, want @ target.lm_head.weight.T, atol=1e-4, rtol=1e-4)


def test_eagle3_head_maps_its_vocabulary_and_fuses_three_layers(tiny_model_factory, runner_factory, tmp_path):
    target_path = tiny_model_factory("LlamaForCausalLM", num_hidden_layers=4)
    target = runner_factory(target_path).model
    path = write_eagle_head(str(tmp_path / "eagle3"), target_path, "eagle3")
    runner = head_runner(path, "LlamaForCausalLMEagle3", target)
    head = runner.model
    assert head.hot_token_ids is not None and head.hot_token_ids.tolist() == [3 * i for i in range(64)]
    assert head.lm_head is not target.lm_head
    # the first row fuses the target's three layers (192 wide); a deeper level feeds its own 64
    first = extend(runner, [17, 5], spec_hidden=torch.randn(2, 192))
    assert first.next_token_logits.shape == (1, 64) and first.hidden_states.shape == (2, 64)
    deeper = extend(runner, [9], spec_hidden=first.hidden_states[-1:])
    assert deeper.next_token_logits.shape == (1, 64)


@pytest.mark.parametrize(
    "kind,change,message",
    [
        ("eagle", {"hidden_size": 32}, "hidden states of size 32"),
        ("eagle3", {"target_hidden_size": 48}, "hidden states of size 48"),
        ("eagle", {"vocab_size": 500}, "vocabulary has 500 tokens"),
        ("eagle3", {"architectures": ["MistralForCausalLM"]}, "names architecture LlamaForCausalLMEagle3"),
    ],
)
def test_heads_that_do_not_fit_are_refused(kind, change, message, tiny_model_factory, tmp_path):
    from srt.configs.model_config import ModelLoadError
    from srt.server_args import ServerArgs
    from srt.speculative.eagle_worker import head_config

    target_path = tiny_model_factory("LlamaForCausalLM", num_hidden_layers=4)
    path = write_eagle_head(str(tmp_path / kind), target_path, kind, **change)
    args = ServerArgs(model_path=target_path, speculative_algorithm=kind.upper(), speculative_draft_model_path=path)
    with pytest.raises(ModelLoadError, match=message) as e:
        head_config(args, ModelConfig.from_path(target_path))
    assert "--speculative-draft-model-path" in str(e.value) or "architecture" in str(e.value)


def test_tree_keeps_the_best_nodes_with_their_parents_in_bfs_order():
    from srt.speculative.eagle_worker import EagleProposer

    # (token, parent, cumulative probability, depth)
    nodes = [
        (10, -1, 0.5, 1),
        (11, -1, 0.3, 1),
        (12, 0, 0.4, 2),  # 0.4 under a 0.5 parent
        (13, 1, 0.3, 2),  # ties its parent: still after it
        (14, 2, 0.35, 3),
        (15, 3, 0.01, 3),
    ]
    tree = EagleProposer._tree(nodes, budget=4)
    assert tree.tokens[1:] == [10, 11, 12, 14] and tree.parents == [-1, 0, 0, 1, 3]
    assert tree.depths == [0, 1, 1, 2, 3]
    whole = EagleProposer._tree(nodes, budget=10)
    assert sorted(whole.tokens[1:]) == [10, 11, 12, 13, 14, 15]
    assert all(whole.parents[i] < i for i in range(1, len(whole)))
    assert EagleProposer._tree(nodes, budget=0).num_drafts == 0


def test_mtp_layer_loads_from_the_target_checkpoint_and_computes_its_formula(tmp_path, runner_factory):
    """DeepSeek-V3's MTP layer (checkpoint layer n) as a head: enorm / hnorm / eh_proj, a DeepSeek
    decoder layer (MoE, as layer n would have), shared_head; a model without MTP layers, or EAGLE-3
    on one, is refused with the flags named."""
    from conftest import add_mtp_layer, build_tiny_model

    from srt.configs.model_config import ModelLoadError
    from srt.layers.moe.block import SparseMoeBlock
    from srt.server_args import ServerArgs
    from srt.speculative.eagle_worker import head_config

    path = build_tiny_model(str(tmp_path / "v3"), "DeepseekV3ForCausalLM")
    plain = ModelConfig.from_path(path)
    args = ServerArgs(model_path=path, speculative_algorithm="EAGLE")
    with pytest.raises(ModelLoadError, match="num_nextn_predict_layers"):
        head_config(args, plain)
    # attention and MLP outputs zeroed (the decoder layer adds nothing), eh_proj random again
    add_mtp_layer(path, bigram=True)
    from safetensors.torch import load_file, save_file

    w = load_file(os.path.join(path, "model.safetensors"))
    w["model.layers.3.eh_proj.weight"] = torch.randn(64, 128) * 0.1
    save_file(w, os.path.join(path, "model.safetensors"))
    target_config = ModelConfig.from_path(path)
    config = head_config(args, target_config)
    assert (config.architecture, config.num_hidden_layers, config.path) == ("DeepseekV3ForCausalLMNextN", 1, path)
    eagle3 = ServerArgs(model_path=path, speculative_algorithm="EAGLE3", speculative_draft_model_path=path)
    with pytest.raises(ModelLoadError, match="EAGLE3 --speculative-draft-model-path .* own MTP layers"):
        head_config(eagle3, target_config)
    target = runner_factory(path).model  # the target's own load skips layer 3
    head = head_runner(path, "DeepseekV3ForCausalLMNextN", target)
    assert isinstance(head.model.decoder.mlp, SparseMoeBlock) and head.model.lm_head is not target.lm_head
    # one row by hand: shared_head.norm(eh_proj([enorm(embedding), hnorm(hidden)])), its own LM head

    def rms(x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    tok, hidden = 17, torch.randn(1, 64)
    x = torch.cat([rms(target.model.embed_tokens.weight[tok : tok + 1]), rms(hidden)], -1)
    want = rms(x @ w["model.layers.3.eh_proj.weight"].T) * w["model.norm.weight"]
    out = extend(head, [tok], spec_hidden=hidden)
    torch.testing.assert_close(out.hidden_states, want, atol=1e-4, rtol=1e-4)
    logits = want @ w["model.layers.3.shared_head.head.weight"].T
    torch.testing.assert_close(out.next_token_logits, logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "content,message",
    [
        ([[1, 2], [3, 4]], "1-D list"),
        ([], "non-empty"),
        ([1.5, 2.0], "integer token ids"),
        ([5, 70000], r"in \[0, 49152\)"),
        ([5, 5], "repeat"),
        ("not a list", "cannot read"),
    ],
)
def test_bad_token_maps_are_refused_with_the_flag(content, message, tmp_path):
    import json

    from srt.configs.model_config import ModelLoadError
    from srt.speculative.eagle_worker import load_token_map

    path = tmp_path / "map.json"
    path.write_text(json.dumps(content) if content != "not a list" else "{nope")
    with pytest.raises(ModelLoadError, match=message) as e:
        load_token_map(str(path), 49152)
    assert f"--speculative-token-map {path}" in str(e.value)
    torch.save(torch.tensor([3, 1, 2]), tmp_path / "ok.pt")
    assert load_token_map(str(tmp_path / "ok.pt"), 49152).tolist() == [3, 1, 2]


def test_the_training_scripts_head_computes_what_the_server_runs(tiny_model_factory, runner_factory, tmp_path):
    """benchmark/train_eagle.py trains its own (autograd) copy of the EAGLE head: on the same weights
    its first draft level must give the server's head's outputs row for row, or a trained head
    would be useless when served."""
    import json
    import sys

    from safetensors.torch import load_file

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmark"))
    import train_eagle

    target_path = tiny_model_factory("LlamaForCausalLM", num_hidden_layers=4)
    target = runner_factory(target_path).model
    path = write_eagle_head(str(tmp_path / "eagle"), target_path, "eagle")
    with open(os.path.join(target_path, "config.json")) as f:
        cfg = json.load(f)
    weights = load_file(os.path.join(path, "model.safetensors"))
    trained = train_eagle.Head(cfg, {n: weights[n] for n in train_eagle.NAMES}).eval()
    served = head_runner(path, "LlamaForCausalLMEagle", target)
    tokens = [5, 17, 300, 42, 9, 77, 101, 250]
    feat = torch.randn(len(tokens), 64)
    emb = target.model.embed_tokens.weight[tokens]
    with torch.no_grad():
        want = trained.passes(emb[None], feat[None], depth=1)[0][0]
    out = extend(served, tokens, spec_hidden=feat)
    torch.testing.assert_close(out.hidden_states, want, atol=1e-4, rtol=1e-4)

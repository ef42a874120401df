"""ServerArgs: one declaration per option, the CLI and the checks derived from it."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from srt.configs import runtime_choices
from srt.configs.options import flag, option_of
from srt.launch_server import parse_args
from srt.server_args import ServerArgs


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser


def test_every_field_has_a_flag_with_help():
    parser = _parser()
    actions = {a.dest: a for a in parser._actions}
    groups = {a.dest: g.title for g in parser._action_groups for a in g._group_actions}
    for f in dataclasses.fields(ServerArgs):
        action = actions[f.name]
        assert flag(f.name) in action.option_strings, f.name
        assert action.help and action.help.strip(), f.name
        assert groups[f.name] == option_of(f).group, f.name


def test_cli_defaults_are_the_dataclass_defaults():
    parsed = vars(_parser().parse_args([]))
    assert parsed == {f.name: f.default for f in dataclasses.fields(ServerArgs)}
    assert ServerArgs.from_cli_args(_parser().parse_args([])) == ServerArgs()


def test_help_lists_every_flag_with_its_default(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # undo the help formatter's line wrapping
    for f in dataclasses.fields(ServerArgs):
        assert flag(f.name) in text, f.name
    fields = dataclasses.fields(ServerArgs)
    in_help_texts = sum(" ".join(option_of(f).help.split()).count("(default: ") for f in fields)
    assert text.count("(default: ") == len(fields) + in_help_texts


def test_flag_spellings():
    args = parse_args(["--tp", "2", "--ep", "2", "--dp", "1", "--speculative-algorithm", "ngram"])
    assert (args.tp_size, args.ep_size, args.dp_size) == (2, 2, 1)
    assert args.speculative_algorithm == "NGRAM" and args.speculative_num_steps == 7
    namespace = _parser().parse_args(
        ["--lora-paths", "a=/x", "b=/y", "--disable-radix-cache", "--log-requests-level", "3"]
    )
    assert namespace.lora_paths == ["a=/x", "b=/y"] and namespace.log_requests_level == 3
    assert namespace.disable_radix_cache is True
    # SGLang's flags for features that are always on here are accepted
    assert _parser().parse_args(["--enable-cache-report"]).enable_cache_report is True
    pooling = parse_args(["--is-embedding", "--rerank-response-format", "cohere", "--max-pooling-batch-tokens", "64"])
    assert (pooling.is_embedding, pooling.rerank_response_format, pooling.max_pooling_batch_tokens) == (
        True,
        "cohere",
        64,
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(page_size=0), "--page-size must be >= 1, got 0"),
        (dict(max_queued_tokens=-1), "--max-queued-tokens must be >= 0, got -1"),
        (dict(request_timeout=0.0), "--request-timeout must be > 0, got 0.0"),
        (dict(mem_fraction_static=1.0), r"--mem-fraction-static must be in \(0, 1\), got 1.0"),
        (dict(cuda_graph_max_bs=5000), r"--cuda-graph-max-bs must be in \[1, 4096\], got 5000"),
        (dict(disaggregation_bootstrap_port=0), r"--disaggregation-bootstrap-port must be in \[1, 65535\], got 0"),
        (dict(port=70000), r"--port must be in \[1, 65535\], got 70000"),
        (dict(load_format="gguf"), "--load-format must be one of auto, dummy; got 'gguf'"),
        (dict(schedule_policy="sjf"), "--schedule-policy must be one of fcfs, lpm, .*; got 'sjf'"),
        (dict(log_requests_level=5), "--log-requests-level must be one of 0, 1, 2, 3; got 5"),
        (dict(device="tpu"), "--device must be one of auto, cpu, cuda; got 'tpu'"),
        (dict(chunked_prefill_size=0), r"--chunked-prefill-size must be > 0 or -1 \(off\), got 0"),
        (dict(num_continuous_decode_steps=0), "--num-continuous-decode-steps must be >= 1, got 0"),
        (dict(schedule_conservativeness=0.0), "--schedule-conservativeness must be > 0, got 0.0"),
        (
            dict(num_continuous_decode_steps=4, speculative_algorithm="NGRAM"),
            "--num-continuous-decode-steps 4 and --speculative-algorithm NGRAM both decide",
        ),
        (dict(num_unstreamed_decode_steps=0), "--num-unstreamed-decode-steps must be >= 1, got 0"),
        (
            dict(num_unstreamed_decode_steps=8, speculative_algorithm="NGRAM"),
            "--num-unstreamed-decode-steps 8 and --speculative-algorithm NGRAM both decide",
        ),
    ],
)
def test_declared_checks_name_the_flag_the_value_and_the_limit(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(**kwargs)


def test_a_bad_value_on_the_command_line_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--page-size", "0"])
    assert exit_info.value.code == 2
    assert "--page-size must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--grammar-backend", "outlines"])
    assert "invalid choice: 'outlines'" in capsys.readouterr().err


def test_feature_groups_fill_their_automatic_values():
    args = ServerArgs(torchao_config="int4wo-64", hicache_storage_backend="none")
    assert (args.quantization, args.quantization_group_size) == ("int4_weight_only", 64)
    assert args.hicache_storage_backend is None
    with pytest.raises(ValueError, match="--hicache-storage-backend needs --enable-hierarchical-cache"):
        ServerArgs(hicache_storage_backend="file")
    with pytest.raises(ValueError, match="--disaggregation-mode decode does not combine with --speculative-algorithm"):
        ServerArgs(disaggregation_mode="decode", disaggregation_transfer_backend="fake", speculative_algorithm="NGRAM")


def test_choices_agree_with_the_feature_registries():
    from srt.disaggregation.utils import TRANSFER_BACKENDS, DisaggregationMode
    from srt.lora.backend import LORA_BACKENDS

    assert runtime_choices.DISAGGREGATION_MODES == tuple(m.value for m in DisaggregationMode)
    assert runtime_choices.DISAGGREGATION_TRANSFER_BACKENDS == TRANSFER_BACKENDS
    assert runtime_choices.LORA_BACKENDS == LORA_BACKENDS

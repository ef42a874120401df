"""The speculative decoding option group's start-up checks; fills the automatic values."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from srt.server_args import ServerArgs

# automatic (num_steps, eagle_topk, num_draft_tokens): NGRAM drafts a chain of up to 7 tokens (wider
# trees with --speculative-ngram-max-bfs-breadth); a draft model a chain of 4
AUTO_SPECULATIVE = {"NGRAM": (7, 1, 8), "STANDALONE": (4, 1, 5), "EAGLE": (5, 4, 8), "EAGLE3": (5, 4, 8)}
_TREE_FLAGS = ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens")


def check_speculative_server_args(server_args: ServerArgs) -> None:
    algo = server_args.speculative_algorithm
    if algo is None:
        flags = (*_TREE_FLAGS, "speculative_draft_model_path", "speculative_token_map")
        given = [f for f in flags if getattr(server_args, f) is not None]
        if given:
            raise ValueError(f"--{given[0].replace('_', '-')} needs --speculative-algorithm")
        return
    if algo in ("STANDALONE", "EAGLE", "EAGLE3"):
        # EAGLE without a path drafts with the model's own MTP layers (checked against the model at start-up)
        if server_args.speculative_draft_model_path is None and algo != "EAGLE":
            raise ValueError(f"--speculative-algorithm {algo} needs --speculative-draft-model-path")
        if server_args.tp_size > 1 and algo == "STANDALONE":
            raise ValueError(f"--speculative-algorithm {algo} does not work with --tp-size > 1 yet")
    elif server_args.speculative_draft_model_path is not None:
        raise ValueError(
            "--speculative-draft-model-path is for STANDALONE, EAGLE and EAGLE3; NGRAM proposes from its n-gram cache"
        )
    if server_args.speculative_token_map is not None and algo != "EAGLE":
        raise ValueError(f"--speculative-token-map is for EAGLE heads that share the target's LM head; not {algo}")
    set_ = [getattr(server_args, f) is not None for f in _TREE_FLAGS]
    if any(set_) and not all(set_):
        raise ValueError(
            "--speculative-num-steps, --speculative-eagle-topk and --speculative-num-draft-tokens: "
            "set all three or none (automatic values)"
        )
    if not any(set_):
        (
            server_args.speculative_num_steps,
            server_args.speculative_eagle_topk,
            server_args.speculative_num_draft_tokens,
        ) = AUTO_SPECULATIVE[algo]
    steps = server_args.speculative_num_steps
    topk = server_args.speculative_eagle_topk
    tokens = server_args.speculative_num_draft_tokens
    assert steps is not None and topk is not None and tokens is not None
    if steps < 1 or topk < 1 or tokens < 2:
        raise ValueError(
            "--speculative-num-steps and --speculative-eagle-topk must be >= 1 and "
            f"--speculative-num-draft-tokens >= 2; got {steps}, {topk}, {tokens}"
        )
    if algo == "STANDALONE" and tokens - 1 > steps * topk:
        raise ValueError(
            f"--speculative-num-draft-tokens {tokens} is more than the root and --speculative-num-steps "
            f"({steps}) x --speculative-eagle-topk ({topk}) draft tokens"
        )
    for what in ("match_window_size", "bfs_breadth"):
        lo, hi = (getattr(server_args, f"speculative_ngram_{end}_{what}") for end in ("min", "max"))
        if not 1 <= lo <= hi:
            flag = "--speculative-ngram-{}-" + what.replace("_", "-")
            raise ValueError(f"{flag.format('min')} must be >= 1 and <= {flag.format('max')}; got {lo} and {hi}")
    if server_args.speculative_ngram_capacity < 1000:
        raise ValueError(f"--speculative-ngram-capacity must be >= 1000, got {server_args.speculative_ngram_capacity}")
    if server_args.enable_overlap_schedule:
        raise ValueError(
            "--enable-overlap-schedule does not work with --speculative-algorithm yet: each step's "
            "drafts depend on the previous step's accepted tokens"
        )
